"""The toy task where zooming wins (`mmpg.toy.zoom_task`): on the written videos, decoded as training decodes them,
the overview's frames show the field and never the flash, a zoom on the rule policy's window shows the flash, and
the rule policy's trajectories (the cold start's) zoom there and answer the flash with the times the clip writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmpg.data.samples import GroundingSample
from mmpg.data.video import VideoSpec, load_video
from mmpg.rewards import temporal_iou
from mmpg.rollout.zoom import ZoomCall, ZoomEnvironment, ZoomSettings, call_text, parse_call
from mmpg.toy.zoom_task import (FIELD_S, FLASH_S, ZoomTask, clip_times, write_zoom_dataset, written_times,
                                 zoom_scene)

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
        _copied_from_the_clip(line, truth, env, dataset)


def _copied_from_the_clip(line: dict, truth: dict, env: ZoomEnvironment, root) -> None:
    """The trajectory's clip, as the zoom tool decodes it, shows the flash, and its answer is copied from it."""
    sample = GroundingSample("v", str(root / line["video"]), TASK.duration, "the white flash", tuple(truth["flash"]))
    clip = env.step(sample, line["messages"][0]["content"], 0).clip
    white = _corner_white(clip.frames).tolist()
    seen = [t for t, w in zip(clip.timestamps, white) if w]
    assert len(seen) >= 2 and truth["flash"][0] - 0.2 <= seen[0] and seen[-1] <= truth["flash"][1] + 0.2
    # the answer is copied from the clip as decoded: the time written before the first pair of frames showing
    # the flash, and before the pair after the last one showing it
    written = written_times(clip.timestamps)
    pairs = [any(white[2 * k: 2 * k + 2]) for k in range(len(written))]
    first, last = pairs.index(True), len(pairs) - 1 - pairs[::-1].index(True)
    assert last + 1 < len(written)  # the window closes after the flash: the end is a written time too
    assert line["messages"][-1]["content"].endswith(f"<answer>{written[first]} to {written[last + 1]}</answer>")
    assert line["answer"] == [float(written[first]), float(written[last + 1])]
    # a copied answer spans one or two pairs (0.5-1 s) from the flash's first pair: tIoU >= 0.25 with the 0.5-s
    # flash (exactly 1/3 at worst before the 0.1-s rounding of the written times)
    assert temporal_iou(tuple(line["answer"]), tuple(truth["flash"])) >= 0.25
    # one look can answer at best the field: its tIoU with the flash is at most FLASH_S / its length
    assert temporal_iou(tuple(truth["field"]), tuple(truth["flash"])) <= FLASH_S / FIELD_S[0] + 1e-9


def test_shifted_windows_add_clips_holding_the_flash_and_answers_copied_from_them(dataset, tmp_path):
    """`windows=3` (`mmpg synth --zoom --zoom-windows 3`): the same videos; each training video's rule trajectory
    first, then two more on windows of its length moved along the video on the zoom's grid, each holding the flash
    inside its ends, the answer copied from that clip as decoded; `mmpg sft` reads them all."""
    from mmpg.sft.trajectories import load_trajectories

    out = tmp_path / "w"
    assert write_zoom_dataset(out, 4, seed=3, task=TASK, windows=3)["trajectories"] == 9
    assert (out / "events.json").read_text() == (dataset / "events.json").read_text()
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert lines[0::3] == (dataset / "trajectories.jsonl").read_text().splitlines()  # the rule's, as with windows=1
    events = json.loads((dataset / "events.json").read_text())
    env = ZoomEnvironment(ZoomSettings(fps=TASK.zoom_fps, max_frames=TASK.zoom_max_frames, max_turns=1), SPEC)
    for k in range(0, 9, 3):
        group = [json.loads(x) for x in lines[k: k + 3]]
        windows = [tuple(g["window"]) for g in group]
        assert len(set(windows)) == 3 and {g["video"] for g in group} == {group[0]["video"]}
        for (start, end), line in zip(windows[1:], group[1:]):
            truth = events[line["video"].split("/")[-1][:-4]]
            assert end - start == pytest.approx(windows[0][1] - windows[0][0])
            assert (start * TASK.zoom_fps) == pytest.approx(round(start * TASK.zoom_fps))  # on the zoom's grid
            assert 0.0 <= start and end <= TASK.duration
            assert start + 0.5 <= truth["flash"][0] + 1e-9 and truth["flash"][1] + 1.0 <= end + 1e-9
            assert parse_call(line["messages"][0]["content"]) == ZoomCall(start, end)
            _copied_from_the_clip(line, truth, env, out)
    assert len(load_trajectories(out / "trajectories.jsonl")) == 9
    for k, line in enumerate(lines):  # the shifted calls, drawn knowing the flash, are not trained on
        assert json.loads(line)["messages"][0].get("weight", 1) == (1 if k % 3 == 0 else 0)
    with pytest.raises(Exception, match="writes >= 1 trajectory per training video"):
        write_zoom_dataset(tmp_path / "none", 4, task=TASK, windows=0)


def test_written_times_are_the_ones_qwen3_vl_writes_before_each_pair(dataset, load_tiny):
    """The rule policy copies the times Qwen3-VL's processor writes before each pair of a clip's frames, decoded by
    the zoom tool (an odd frame count included: the processor pads the last pair with the last frame)."""
    import re

    from mmpg.rollout.zoom import turn_inputs

    _, processor = load_tiny("qwen3_vl")
    spec = VideoSpec.for_family("qwen3_vl", fps=TASK.overview_fps, min_frames=4, max_frames=768,
                                min_pixels=64 * 64, max_pixels=64 * 64)
    env = ZoomEnvironment(ZoomSettings(fps=TASK.zoom_fps, max_frames=TASK.zoom_max_frames, max_turns=1), spec)
    vid = json.loads((dataset / "trajectories.jsonl").read_text().splitlines()[0])["video"]
    sample = GroundingSample("v", str(dataset / vid), TASK.duration, "the white flash", (1.0, 1.5))
    for start, end in [(6.25, 14.75), (3.0, 4.5), (10.1, 12.3)]:
        turn = env.step(sample, call_text(start, end), 0)
        ids, _ = turn_inputs(processor, turn)
        text = processor.tokenizer.decode(ids)
        assert re.findall(r"<([0-9.]+) seconds>", text) == written_times(turn.clip.timestamps), (start, end)
    assert written_times([1.0, 1.25, 1.5]) == ["1.1", "1.5"]


def test_the_stamps_rule_zooms_between_times_the_overview_prompt_writes(tmp_path, load_tiny):
    """`window_rule="stamps"` (`mmpg synth --zoom --zoom-rule stamps`): the rule's window runs from the time Qwen3-VL's
    prompt writes before the pair of overview frames ahead of the first pair showing the square to the time written
    before the pair after the last one (so the call copies two numbers of the prompt); it holds the square and the
    flash, its clip shows the flash and the answer is copied from it; shifted windows stay short decimals."""
    import re

    from mmpg.data.prompts import build_prompt_inputs, get_template

    task = ZoomTask(duration=30.0, window_rule="stamps", zoom_max_frames=74)
    assert task.problem() is None
    out = tmp_path / "stamps"
    write_zoom_dataset(out, 4, seed=3, task=task, windows=2)
    _, processor = load_tiny("qwen3_vl")
    spec = VideoSpec.for_family("qwen3_vl", fps=task.overview_fps, min_frames=4, max_frames=768,
                                min_pixels=64 * 64, max_pixels=64 * 64)
    events = json.loads((out / "events.json").read_text())
    lines = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    env = ZoomEnvironment(ZoomSettings(fps=task.zoom_fps, max_frames=task.zoom_max_frames, max_turns=1), spec)
    for k, line in enumerate(lines):
        truth = events[line["video"].split("/")[-1][:-4]]
        start, end = line["window"]
        assert start <= truth["flash"][0] and truth["flash"][1] <= end
        assert not re.search(r"\d\.\d{3,}", line["messages"][0]["content"])  # 10.7, not 10.700000000000001
        _copied_from_the_clip(line, truth, env, out)
        if k % 2:
            continue
        assert start <= truth["field"][0] and truth["field"][1] <= end  # the rule's window: the whole square
        sample = GroundingSample("v", str(out / line["video"]), task.duration, "the white flash", (1.0, 1.5))
        video = load_video(sample.video, spec)
        ids = build_prompt_inputs(processor, [sample], [video], get_template("zoom"))["input_ids"][0]
        stamps = re.findall(r"<([0-9.]+) seconds>", processor.tokenizer.decode(ids))
        assert stamps == written_times(video.timestamps)
        pairs = [any(truth["field"][0] <= t < truth["field"][1] for t in video.timestamps[2 * j: 2 * j + 2])
                 for j in range(len(stamps))]
        first, last = pairs.index(True), len(pairs) - 1 - pairs[::-1].index(True)
        want = (float(stamps[first - 1]) if first else 0.0, float(stamps[last + 1]) if last + 1 < len(stamps)
                else task.duration)
        assert (start, end) == want
    # 30 s at 0.5 fps: frames 2.3 s apart, so the square may show in 4 frames of 3 pairs; the window around them
    assert "(the written times around 3 frame pairs), past 48 zoom frames at 4 fps: allow >= 74 zoom frames" in \
        ZoomTask(duration=30.0, window_rule="stamps").problem()
    assert "window rule 'frame'" in ZoomTask(window_rule="frame").problem()


def test_the_rule_policy_reads_the_frames_the_tool_decodes(dataset):
    """`clip_times` (the rule's frames, computed without decoding) are the ones the zoom tool decodes: qwen-vl-utils'
    sampling spreads a window's frames over it, off the 1/fps grid from its start."""
    events = json.loads((dataset / "events.json").read_text())
    env = ZoomEnvironment(ZoomSettings(fps=TASK.zoom_fps, max_frames=TASK.zoom_max_frames, max_turns=1), SPEC)
    vid = next(iter(events))
    scene = zoom_scene(np.random.default_rng(0), "any", TASK)  # the task's frame rate and length, as the files'
    sample = GroundingSample(vid, str(dataset / "videos" / f"{vid}.mp4"), TASK.duration, "the white flash",
                             (1.0, 1.5))
    for start, end in [(6.25, 14.75), (2.0, 9.5), (0.0, 12.0)]:
        clip = env.step(sample, call_text(start, end), 0).clip
        assert clip_times(scene, TASK, start, end) == pytest.approx(clip.timestamps), (start, end)


def test_same_seed_same_videos(dataset, tmp_path):
    again = write_zoom_dataset(tmp_path / "again", 4, seed=3, task=TASK)
    assert (tmp_path / "again" / "events.json").read_text() == (dataset / "events.json").read_text()
    assert again["videos"] == 4
    with pytest.raises(Exception, match="is not empty; pass --overwrite"):
        write_zoom_dataset(tmp_path / "again", 4, seed=3, task=TASK)


def test_sizes_that_cannot_make_the_task_are_refused():
    assert ZoomTask().problem() is None and TASK.problem() is None
    assert ZoomTask(duration=120.0, overview_fps=0.25, zoom_max_frames=50).problem() is None  # frames 4.25 s apart
    assert "too short" in ZoomTask(duration=10.0).problem()
    assert "may miss the 6-s square" in ZoomTask(overview_fps=0.15).problem()
    # 40 s at 0.25 fps: 10 frames up to 4.5 s apart; a window from the frame before the square reaches 4.5 + 8 s,
    # and a zoom frame more for the window's start on the zoom's grid: 12.75 s at 4 fps
    assert "allow >= 51 zoom frames" in ZoomTask(overview_fps=0.25).problem()
    with pytest.raises(Exception, match="allow >= 51 zoom frames"):
        write_zoom_dataset("unused", 4, task=ZoomTask(overview_fps=0.25))


def test_mmpg_synth_zoom_writes_the_task(tmp_path):
    """The defaults, then a longer task (a minute at a 0.25-fps overview): its overview never shows the flash, the
    rule policy's windows (up to 13 s) fit the zoom frames asked for, and sizes that cannot work are one line."""
    from train_utils import run_cli

    proc = run_cli(["synth", "--zoom", "--out", str(tmp_path / "z"), "--n", "2", "--seed", "1"])
    assert proc.returncode == 0, proc.stderr
    assert "wrote 2 zoom-task videos" in proc.stdout
    assert "data.fps=0.5 zoom.fps=4 zoom.max_frames=48" in proc.stdout
    proc = run_cli(["synth", "--zoom", "--out", str(tmp_path / "long"), "--n", "3", "--seed", "1",
                    "--zoom-duration", "60", "--overview-fps", "0.25", "--zoom-frames", "52", "--zoom-windows", "2"])
    assert proc.returncode == 0, proc.stderr
    assert "data.fps=0.25 zoom.fps=4 zoom.max_frames=52" in proc.stdout
    assert "2 train, 1 test) and the rule policy's trajectories (4)" in proc.stdout
    assert len((tmp_path / "long" / "trajectories.jsonl").read_text().splitlines()) == 4  # 2 windows a video
    task = ZoomTask(duration=60.0, overview_fps=0.25, zoom_max_frames=52)
    spec = VideoSpec.for_family("qwen2_5_vl", fps=0.25, min_frames=4, max_frames=768, min_pixels=56 * 56,
                                max_pixels=56 * 56)
    events = json.loads((tmp_path / "long" / "events.json").read_text())
    for vid, truth in events.items():
        video = load_video(str(tmp_path / "long" / "videos" / f"{vid}.mp4"), spec)
        assert video.timestamps == pytest.approx(task.overview_times())
        assert not bool(_corner_white(video.frames).any()), vid
    for line in (tmp_path / "long" / "trajectories.jsonl").read_text().splitlines():
        traj = json.loads(line)
        flash = events[traj["video"].split("/")[-1][:-4]]["flash"]
        assert traj["window"][0] <= flash[0] and flash[1] <= traj["window"][1]
        assert traj["window"][1] - traj["window"][0] <= 13.0
    proc = run_cli(["synth", "--zoom", "--out", str(tmp_path / "bad"), "--n", "2", "--overview-fps", "0.25"])
    assert proc.returncode == 2 and "allow >= 51 zoom frames" in proc.stderr, proc.stderr
    proc = run_cli(["synth", "--zoom", "--out", str(tmp_path / "bad"), "--n", "2", "--zoom-rule", "stamps"])
    assert proc.returncode == 2 and "(the written times around 3 frame pairs)" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "z").iterdir()) == ["events.json", "test.json", "train.json",
                                                                  "trajectories.jsonl", "videos"]


def test_the_scenes_are_redrawn_without_rendering(dataset):
    """`zoom_scenes(n, seed, task)` draws the scenes `write_zoom_dataset` rendered, in its order: their events are
    events.json's and the rule's window of each training scene is the one its trajectory calls."""
    from mmpg.toy.zoom_task import rule_window, zoom_scenes

    scenes = zoom_scenes(4, 3, TASK)
    events = json.loads((dataset / "events.json").read_text())
    assert [s.video_id for s in scenes] == sorted(events)
    for s in scenes:
        field, flash = s.events
        assert events[s.video_id] == {"field": [field.start, field.end], "colour": field.colour,
                                      "flash": [flash.start, flash.end]}
    test = json.loads((dataset / "test.json").read_text())
    assert list(test) == [scenes[-1].video_id]  # the last quarter is the test split
    lines = [json.loads(x) for x in (dataset / "trajectories.jsonl").read_text().splitlines()]
    by_id = {s.video_id: s for s in scenes}
    assert len(lines) == 3
    for line in lines:
        video_id = line["video"].split("/")[-1].removesuffix(".mp4")
        assert list(rule_window(by_id[video_id], TASK)) == line["window"]


def test_the_experiment_reads_first_calls_as_the_tool_parses_them(tmp_path):
    """`mmpg.toy.demo.zoom_learning.first_calls`: the share of test videos whose first turn calls the rule's window
    exactly (parsed as the tool parses it), and how many distinct windows the first turns called."""
    from mmpg.toy.demo.zoom_learning import first_calls, rule_windows

    windows = rule_windows(8)
    ids = sorted(windows)[-3:]
    start, end = windows[ids[0]]
    other = windows[ids[1]]
    turns = [call_text(start, end), call_text(other[0] + 1.0, other[1]), "<answer>3.0 to 4.0</answer>"]
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps({"video": f"/videos/{i}.mp4", "turns": [{"model": t}]}) + "\n"
                            for i, t in zip(ids, turns)))
    assert first_calls(path, windows) == {"rule_call_share": 1 / 3, "distinct_calls": 2}
    path.write_text(json.dumps({"video": f"/videos/{ids[1]}.mp4", "turns": [{"model": call_text(*other)}]}) + "\n")
    assert first_calls(path, windows) == {"rule_call_share": 1.0, "distinct_calls": 1}
