"""`mmpg eval` with a video's queries batched together (share_videos, the default) on a split asking 2.8 questions per
video, with the tiny Qwen2.5-VL checkpoint on the CPU: the same answers and metrics as fixed batches, each video
decoded once per batch and encoded once by the vision tower, a resumed run ending the same, a failed video failing
each of its queries. (Two ranks with share_videos: tests/test_eval_run.py, whose train split asks up to 3 per video.)"""

from __future__ import annotations

import json
import shutil

import pytest

from mmpg.data import dataset as dataset_mod
from mmpg.eval.runner import evaluate_checkpoint
from mmpg.eval.settings import load_settings
from mmpg.runs.evals import EvalReader

pytestmark = pytest.mark.slow

FAST = ["fps=1", "max_frames=4", "min_pixels=3136", "max_pixels=3136", "max_new_tokens=8", "num_workers=0",
        "batch_size=4", "self_check=off"]
QUERIES = [3, 3, 2, 3, 3]  # per video: 14 queries of 5 videos


def _answers(folder):
    return [(r.index, r.sample_id, r.text, r.pred_span, r.iou, r.error) for r in EvalReader(folder).predictions()]


def _scores(metrics: dict) -> dict:
    """metrics.json without the perf/* counts (what the decoding cost, not what it found)."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _split(synth, path, bad: dict | None = None):
    """A JSONL benchmark over 5 synthetic videos asking QUERIES[v] questions each, interleaved (v0 q0, v1 q0, ...,
    v0 q1, ...) so fixed batches mix videos; `bad`: {video path: queries} of missing or corrupt videos, appended."""
    entries = []
    for name in ("train", "val", "test"):
        entries += json.loads((synth / f"{name}.json").read_text()).items()
    entries = entries[:len(QUERIES)]
    lines = []
    for q in range(max(QUERIES)):
        for v, (vid, e) in enumerate(entries):
            if q < QUERIES[v]:
                k = q % len(e["sentences"])  # a video with fewer sentences asks one again, worded apart
                again = f", seen for the {q + 1}th time" if q >= len(e["sentences"]) else ""
                lines.append({"id": f"{vid}#{q}", "video": str(synth / "videos" / f"{vid}.mp4"),
                              "duration": e["duration"], "query": e["sentences"][k] + again,
                              "span": e["timestamps"][k]})
    for video, count in (bad or {}).items():
        lines += [{"id": f"{video}#{q}", "video": str(video), "duration": 10.0, "query": f"thing {q}",
                   "span": [1, 2]} for q in range(count)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _counted(calls: list, real):
    """The decoder `real`, noting each video it is asked for in `calls` (num_workers=0: it runs in this process)."""
    def load(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    return load


@pytest.fixture
def decodes(monkeypatch):
    """The videos decoded, one entry per decode."""
    calls: list = []
    monkeypatch.setattr(dataset_mod, "load_video", _counted(calls, dataset_mod.load_video))
    return calls


@pytest.fixture(scope="module")
def shared_eval(grpo_data, tmp_path_factory):
    """share_videos on (the default) and off on the same split: (annotations, folders, results, decodes of each)."""
    root = tmp_path_factory.mktemp("share")
    ann = _split(grpo_data["synth"], root / "split.jsonl")
    out, results, decoded = {}, {}, {}
    for mode, extra in (("on", []), ("off", ["share_videos=false"])):
        decoded[mode], out[mode] = [], root / mode
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dataset_mod, "load_video", _counted(decoded[mode], dataset_mod.load_video))
            results[mode] = evaluate_checkpoint(grpo_data["model"], ann, None, out[mode],
                                                load_settings("default", FAST + extra))
    return ann, out, results, decoded


def test_sharing_videos_gives_the_same_answers_and_metrics(shared_eval):
    ann, out, results, decoded = shared_eval
    on, off = results["on"], results["off"]
    assert on.decoded == off.decoded == 14
    assert _answers(out["on"]) == _answers(out["off"])
    assert _scores(EvalReader(out["on"]).metrics()) == _scores(EvalReader(out["off"]).metrics())
    # batches of 4: on: whole videos 3 | 3 | 2 | 3 | 3, each decoded once; off: 4 mixed batches, 14 decodes
    assert len(decoded["on"]) == 5 and sorted(set(decoded["on"])) == sorted(decoded["on"])
    assert len(decoded["off"]) == 14
    assert on.counts.videos == off.counts.videos == 5
    assert on.counts.prefix_tokens <= off.counts.prefix_tokens
    assert off.counts.vision_calls == 14  # fixed batches: no two queries of a video side by side
    m = EvalReader(out["on"]).metrics()
    assert (m["perf/videos"], m["perf/samples_decoded"]) == (5, 14)
    report = (out["on"] / "report.md").read_text()
    assert f"videos 5, vision-tower videos encoded {on.counts.vision_calls}, prefill tokens " in report
    assert "share_videos" in report
    assert EvalReader(out["on"]).info()["runtime"]["share_videos"] is True
    # the vision tower encodes each video once: needs the engine that prefills a video's queries once
    # (HFEngine.generate_groups sharing adjacent prompts of one video, issue 23)
    assert on.counts.vision_calls == 5, f"the vision tower encoded {on.counts.vision_calls} videos for 5"


def test_a_resumed_shared_run_ends_with_the_same_predictions(grpo_data, shared_eval, tmp_path):
    ann, out, results, _ = shared_eval
    killed = tmp_path / "killed"
    shutil.copytree(out["on"], killed)
    lines = (killed / "predictions.jsonl").read_bytes().splitlines(keepends=True)
    # killed after the first two videos' batches and half a line of the third
    (killed / "predictions.jsonl").write_bytes(b"".join(lines[:6]) + lines[6][: len(lines[6]) // 2])
    for name in ("metrics.json", "report.md"):
        (killed / name).unlink()
    result = evaluate_checkpoint(grpo_data["model"], ann, None, killed, load_settings("default", FAST))
    assert (result.decoded, result.reused, result.counts.videos) == (8, 6, 3)
    assert _answers(killed) == _answers(out["on"])
    assert _scores(result.metrics) == _scores(results["on"].metrics)


def test_a_failed_video_fails_each_of_its_queries(grpo_data, tmp_path, decodes):
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    missing = tmp_path / "missing.mp4"
    ann = _split(grpo_data["synth"], tmp_path / "bad.jsonl", {missing: 3, corrupt: 2})
    result = evaluate_checkpoint(grpo_data["model"], ann, None, tmp_path / "out",
                                 load_settings("default", FAST + ["max_samples=0"]))
    m, records = result.metrics, EvalReader(tmp_path / "out").predictions()
    assert (m["total"], m["failed"], m["count"]) == (19, 5, 19)  # bad_videos=fail: scored 0, counted per query
    failed = [r for r in records if r.error is not None]
    assert sorted(r.sample_id for r in failed) == sorted([f"{missing}#{q}" for q in range(3)]
                                                         + [f"{corrupt}#{q}" for q in range(2)])
    assert all("video file not found" in r.error for r in failed if "missing" in r.sample_id)
    assert decodes.count(str(missing)) == 1 and decodes.count(str(corrupt)) == 1  # one batch each: tried once
    assert result.counts.videos == 5  # failed videos are not among those answered
