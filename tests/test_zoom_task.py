"""The toy task where zooming wins (`mmpg.toy.zoom_task`): on the written videos, decoded as training decodes them,
the overview's frames show the field and never the flash, a zoom on the rule policy's window shows the flash, and
the rule policy's trajectories (the cold start's) zoom there and answer the flash."""

from __future__ import annotations

import json

import pytest
import torch

from mmpg.data.samples import GroundingSample
from mmpg.data.video import VideoSpec, load_video
from mmpg.rewards import temporal_iou
from mmpg.rollout.zoom import ZoomCall, ZoomEnvironment, ZoomSettings, parse_call
from mmpg.toy.zoom_task import FIELD_S, FLASH_S, ZoomTask, write_zoom_dataset

TASK = ZoomTask(duration=30.0)
SPEC = VideoSpec.for_family("qwen2_5_vl", fps=TASK.overview_fps, min_frames=4, max_frames=768,
                            min_pixels=56 * 56, max_pixels=56 * 56)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoomtask") / "zoom"
    summary = write_zoom_dataset(out, 4, seed=3, task=TASK)
    assert summary["train"] == 3 and summary["test"] == 1
    return out


def _corner_white(frames: torch.Tensor) -> torch.Tensor:
    """[T] whether the flash's corner (top right) holds a white pixel in each frame ([T, C, H, W], 0..255)."""
    h, w = frames.shape[-2:]
    corner = frames[:, :, : h // 3, 2 * w // 3:]
    return (corner.min(dim=1).values > 180).flatten(1).any(dim=1)


def test_one_look_sees_the_field_and_never_the_flash(dataset):
    events = json.loads((dataset / "events.json").read_text())
    for vid, truth in events.items():
        video = load_video(str(dataset / "videos" / f"{vid}.mp4"), SPEC)
        assert video.timestamps == pytest.approx(TASK.overview_times())  # the frames the flash was placed around
        assert not bool(_corner_white(video.frames).any()), vid
        lo, hi = truth["field"]
        assert any(lo <= t < hi for t in video.timestamps), vid  # the overview does see the field


def test_the_rule_policy_zooms_where_the_flash_is_and_answers_it(dataset):
    events = json.loads((dataset / "events.json").read_text())
    lines = [json.loads(x) for x in (dataset / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    env = ZoomEnvironment(ZoomSettings(fps=TASK.zoom_fps, max_frames=TASK.zoom_max_frames, max_turns=1), SPEC)
    for line in lines:
        vid = line["video"].split("/")[-1][:-4]
        truth = events[vid]
        call = parse_call(line["messages"][0]["content"])
        assert isinstance(call, ZoomCall) and [call.start, call.end] == line["window"]
        assert call.start <= truth["flash"][0] and truth["flash"][1] <= call.end
        assert call.end - call.start <= TASK.zoom_max_frames / TASK.zoom_fps
        sample = GroundingSample(vid, str(dataset / line["video"]), TASK.duration, "the white flash",
                                 tuple(truth["flash"]))
        clip = env.step(sample, line["messages"][0]["content"], 0).clip
        seen = [t for t, white in zip(clip.timestamps, _corner_white(clip.frames).tolist()) if white]
        assert len(seen) >= 2 and truth["flash"][0] - 0.2 <= seen[0] and seen[-1] <= truth["flash"][1] + 0.2
        assert temporal_iou(tuple(line["answer"]), tuple(truth["flash"])) >= 0.5
        assert line["messages"][-1]["content"].endswith(f"<answer>{line['answer'][0]:.2f} to "
                                                        f"{line['answer'][1]:.2f}</answer>")
        # one look can answer at best the field: its tIoU with the flash is at most FLASH_S / its length
        assert temporal_iou(tuple(truth["field"]), tuple(truth["flash"])) <= FLASH_S / FIELD_S[0] + 1e-9


def test_same_seed_same_videos(dataset, tmp_path):
    again = write_zoom_dataset(tmp_path / "again", 4, seed=3, task=TASK)
    assert (tmp_path / "again" / "events.json").read_text() == (dataset / "events.json").read_text()
    assert again["videos"] == 4
    with pytest.raises(Exception, match="is not empty; pass --overwrite"):
        write_zoom_dataset(tmp_path / "again", 4, seed=3, task=TASK)


def test_mmpg_synth_zoom_writes_the_task(tmp_path):
    from train_utils import run_cli

    proc = run_cli(["synth", "--zoom", "--out", str(tmp_path / "z"), "--n", "2", "--seed", "1"])
    assert proc.returncode == 0, proc.stderr
    assert "wrote 2 zoom-task videos" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "z").iterdir()) == ["events.json", "test.json", "train.json",
                                                                  "trajectories.jsonl", "videos"]
