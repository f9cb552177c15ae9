"""The run directory: write a small run, read it back; damaged lines, resume, versions, checkpoints, path safety."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mmpg.errors import UserError
from mmpg.runs import (
    LAYOUT_VERSION,
    GroupRecord,
    ResponseRecord,
    RunReader,
    RunWriter,
    checkpoint_dir,
    finalize_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    metric_series,
    prune_checkpoints,
    read_jsonl,
    temp_checkpoint_dir,
)

CONFIG = "model:\n  name: tiny\ngrpo:\n  group_size: 3\n"


def make_groups(step: int, media_key: str | None = None) -> list[GroupRecord]:
    """2 groups x 3 responses with distinct, exactly representable numbers."""
    groups = []
    for g in range(2):
        responses = [
            ResponseRecord(
                text=f"<answer>{r}.0 to {r + 2}.5</answer>" if r < 2 else "I don't know",
                parsed_span=[float(r), r + 2.5] if r < 2 else None,
                rewards={"overall": 0.25 * r + g, "format": 1.0 if r < 2 else 0.0, "iou": 0.5 * r},
                advantage=r - 1.0,
                length=10 + r,
                finish_reason="stop" if r < 2 else "length",
            )
            for r in range(3)
        ]
        groups.append(
            GroupRecord(
                step=step,
                group_index=g,
                sample_id=f"s{g}",
                video=f"/videos/v{g}.mp4",
                duration=30.5,
                query=f"the person opens door {g}",
                gt_span=[1.0, 4.5],
                media_key=media_key,
                responses=responses,
            )
        )
    return groups


def write_run(run_dir, steps=range(1, 4), tensorboard=False, resume_step=None):
    w = RunWriter(run_dir, tensorboard=tensorboard)
    w.start(CONFIG, kind="grpo", command=["mmpg", "train", "x.yaml"], resume_step=resume_step)
    for step in steps:
        w.log_metrics(step, {"reward/mean": step / 4, "timing_s/rollout": 1.5})
        w.write_rollouts(step, make_groups(step))
    return w


def test_write_and_read_back(tmp_path):
    run = tmp_path / "run"
    w = write_run(run)
    frames = [np.full((24, 32, 3), 40 * i, np.uint8) for i in range(3)]
    key = w.write_thumbnails("/videos/v0.mp4", frames, [0.0, 10.0, 20.5])
    assert w.write_thumbnails("/videos/v0.mp4", frames[:1], [0.0]) == key  # once per video: second call skipped
    w.write_rollouts(4, make_groups(4, media_key=key))
    w.log_eval(3, {"eval/r1@0.5": 0.25, "eval/miou": 0.5})
    tmp = temp_checkpoint_dir(run, 3)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"weights")
    assert finalize_checkpoint(tmp, checkpoint_dir(run, 3)) == run / "checkpoints" / "step_00000003"
    w.close()

    r = RunReader(run)
    info = r.info()
    assert info["layout_version"] == LAYOUT_VERSION and info["kind"] == "grpo"
    assert info["command"] == ["mmpg", "train", "x.yaml"] and "created" in info and "mmpg_version" in info
    assert r.config() == {"model": {"name": "tiny"}, "grpo": {"group_size": 3}}
    metrics = r.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["v"] == 1 for m in metrics)
    assert metric_series(metrics, "reward/mean") == ([1, 2, 3], [0.25, 0.5, 0.75])
    assert [(e["step"], e["eval/miou"]) for e in r.eval_metrics()] == [(3, 0.5)]
    assert r.steps() == [1, 2, 3, 4]
    assert r.rollouts(2) == make_groups(2)
    assert r.rollouts(4) == make_groups(4, media_key=key)
    paths, times = r.thumbnails(key)
    assert [p.name for p in paths] == ["frame_00.jpg", "frame_01.jpg", "frame_02.jpg"] and times == [0.0, 10.0, 20.5]
    from PIL import Image

    with Image.open(paths[2]) as im:
        assert im.size == (32, 24) and abs(np.asarray(im).astype(int).mean() - 80) < 3
    assert r.thumbnails("nokey-123") == ([], [])
    assert r.checkpoints() == [(3, run / "checkpoints" / "step_00000003")]
    assert (run / "checkpoints" / "step_00000003" / "model.safetensors").read_bytes() == b"weights"
    with pytest.raises(UserError, match="steps with rollouts"):
        r.rollouts(9)


def test_not_a_run_directory(tmp_path):
    with pytest.raises(UserError, match="not a run directory"):
        RunReader(tmp_path)
    with pytest.raises(UserError, match="no such folder"):
        RunReader(tmp_path / "missing")


def test_truncated_last_line_is_skipped(tmp_path, caplog):
    run = tmp_path / "run"
    write_run(run).close()
    with open(run / "metrics.jsonl", "ab") as f:  # a writer killed half-way through step 4's line
        f.write(b'{"v":1,"step":4,"reward/me')
    rollout = run / "rollouts" / "step_00000002.jsonl"
    rollout.write_bytes(rollout.read_bytes()[:-40])  # second group cut short
    r = RunReader(run)
    with caplog.at_level(logging.DEBUG, logger="mmpg.runs"):
        assert [m["step"] for m in r.metrics()] == [1, 2, 3]
        assert [m["step"] for m in r.metrics()] == [1, 2, 3]  # polled again: not logged again
    assert len([rec for rec in caplog.records if "metrics.jsonl" in rec.getMessage()]) == 1
    assert r.rollouts(2) == make_groups(2)[:1]
    # The next writer cuts the half line off before appending, so the file stays readable.
    w = RunWriter(run, tensorboard=False)
    w.log_metrics(4, {"reward/mean": 1.0})
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]


def test_complete_last_line_without_newline(tmp_path):
    run = tmp_path / "run"
    write_run(run, steps=[1]).close()
    path = run / "metrics.jsonl"
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    assert [m["step"] for m in read_jsonl(path)] == [1]  # complete, so kept
    w = RunWriter(run, tensorboard=False)
    w.log_metrics(np.int64(2), {"reward/mean": 1.0})  # the writer ends the line before appending
    w.write_rollouts(np.int64(2), make_groups(2))
    assert [m["step"] for m in read_jsonl(path)] == [1, 2] and RunReader(run).steps() == [1, 2]


def test_thumbnail_frames_are_checked(tmp_path):
    w = RunWriter(tmp_path / "run", tensorboard=False)
    with pytest.raises(ValueError, match="frame 1 must be an HxWx3 uint8"):
        w.write_thumbnails("v.mp4", [np.zeros((4, 4, 3), np.uint8), np.zeros((4, 4, 3), np.float32)], [0.0, 1.0])
    with pytest.raises(ValueError, match="2 frames but 1 times"):
        w.write_thumbnails("v.mp4", [np.zeros((4, 4, 3), np.uint8)] * 2, [0.0])
    assert not list((tmp_path / "run" / "media").glob("v-*"))


def test_garbled_middle_line_raises_naming_it(tmp_path):
    run = tmp_path / "run"
    write_run(run).close()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2\b"):
        RunReader(run).metrics()
    rollout = run / "rollouts" / "step_00000001.jsonl"
    first, second = rollout.read_bytes().split(b"\n")[:2]
    rollout.write_bytes(b"\xff\xfe garbage\n" + first + b"\n" + second + b"\n")
    with pytest.raises(ValueError, match=r"step_00000001\.jsonl:1\b"):
        RunReader(run).rollouts(1)


def test_resume_truncates_later_steps(tmp_path):
    run = tmp_path / "run"
    w = write_run(run, steps=range(1, 6))
    w.log_eval(2, {"eval/miou": 0.1})
    w.log_eval(4, {"eval/miou": 0.2})
    w.close()
    created = RunReader(run).info()["created"]
    w = write_run(run, steps=[], resume_step=3)
    r = RunReader(run)
    assert [m["step"] for m in r.metrics()] == [1, 2, 3]
    assert [e["step"] for e in r.eval_metrics()] == [2]
    assert r.steps() == [1, 2, 3]
    assert r.info()["created"] == created  # run.json is written once
    w.log_metrics(4, {"reward/mean": 9.0})
    w.close()
    raw = read_jsonl(run / "metrics.jsonl")  # no de-duplication: the file itself holds step 4 once
    assert [m["step"] for m in raw] == [1, 2, 3, 4] and raw[-1]["reward/mean"] == 9.0


def test_duplicate_steps_keep_the_last(tmp_path):
    run = tmp_path / "run"
    w = write_run(run, steps=[1, 2])
    w.log_metrics(2, {"reward/mean": 7.0})
    w.close()
    assert metric_series(RunReader(run).metrics(), "reward/mean") == ([1, 2], [0.25, 7.0])


def test_non_finite_written_as_null(tmp_path):
    run = tmp_path / "run"
    w = RunWriter(run, tensorboard=False)
    w.start(CONFIG, kind="sft", command=[])
    w.log_metrics(1, {"loss": float("nan"), "grad_norm": float("inf"), "lr": np.float32(0.5), "n": np.int64(3)})
    group = make_groups(1)[0]
    group.responses[0].rewards["iou"] = float("nan")
    group.responses[1].advantage = float("-inf")
    w.write_rollouts(1, [group])
    w.close()
    line = (run / "metrics.jsonl").read_text().strip()
    rec = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert rec["loss"] is None and rec["grad_norm"] is None and rec["lr"] == 0.5 and rec["n"] == 3
    assert metric_series([rec], "loss") == ([], [])
    text = (run / "rollouts" / "step_00000001.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    back = RunReader(run).rollouts(1)[0]
    assert math.isnan(back.responses[0].rewards["iou"]) and math.isnan(back.responses[1].advantage)


def test_newer_version_raises(tmp_path):
    run = tmp_path / "run"
    write_run(run).close()
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"v": LAYOUT_VERSION + 1, "step": 4}) + "\n")
    with pytest.raises(ValueError, match="upgrade mmpg"):
        RunReader(run).metrics()
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "layout_version": LAYOUT_VERSION + 1}))
    with pytest.raises(UserError, match="upgrade mmpg"):
        RunReader(run)


def make_checkpoint(run, step, complete=True):
    tmp = temp_checkpoint_dir(run, step)
    tmp.mkdir(parents=True)
    (tmp / "state.json").write_text(str(step))
    if complete:
        return finalize_checkpoint(tmp, checkpoint_dir(run, step))
    return tmp


def test_checkpoints_listing_ignores_incomplete(tmp_path):
    run = tmp_path / "run"
    assert list_checkpoints(run) == [] and latest_checkpoint(run) is None
    for step in (10, 2, 30):
        make_checkpoint(run, step)
    make_checkpoint(run, 40, complete=False)  # in progress: .tmp-step_00000040
    checkpoint_dir(run, 50).mkdir()  # no COMPLETE
    assert [s for s, _ in list_checkpoints(run)] == [2, 10, 30]
    assert latest_checkpoint(run) == (30, checkpoint_dir(run, 30))
    # Saving a step again replaces it whole.
    tmp = temp_checkpoint_dir(run, 30)
    tmp.mkdir()
    (tmp / "new.json").write_text("new")
    finalize_checkpoint(tmp, checkpoint_dir(run, 30))
    assert sorted(p.name for p in checkpoint_dir(run, 30).iterdir()) == ["COMPLETE", "new.json"]


def test_prune_keeps_the_last_k(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        make_checkpoint(run, step)
    make_checkpoint(run, 5, complete=False)
    assert prune_checkpoints(run, keep_last=0) == [temp_checkpoint_dir(run, 5)]  # stale temp only
    assert [s for s, _ in list_checkpoints(run)] == [1, 2, 3, 4]
    prune_checkpoints(run, keep_last=2)
    assert [s for s, _ in list_checkpoints(run)] == [3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]


def test_resolve_stays_inside(tmp_path):
    run = tmp_path / "run"
    write_run(run).close()
    (tmp_path / "secret.txt").write_text("x")
    os.symlink(tmp_path / "secret.txt", run / "escape.txt")
    r = RunReader(run)
    assert r.resolve("rollouts/step_00000001.jsonl") == (run / "rollouts" / "step_00000001.jsonl").resolve()
    for bad in ("../secret.txt", "rollouts/../../secret.txt", str(tmp_path / "secret.txt"), "escape.txt"):
        with pytest.raises(UserError):
            r.resolve(bad)
    with pytest.raises(UserError):
        r.thumbnails("../run")


def test_other_ranks_write_nothing(tmp_path):
    run = tmp_path / "run"
    w = RunWriter(run, rank=1)
    w.start(CONFIG, kind="grpo", command=[], resume_step=2)
    w.log_metrics(1, {"reward/mean": 0.5})
    w.log_eval(1, {"eval/miou": 0.5})
    w.write_rollouts(1, make_groups(1))
    key = w.write_thumbnails("/videos/v0.mp4", [np.zeros((4, 4, 3), np.uint8)], [0.0])
    w.close()
    assert not run.exists()
    assert key == RunWriter(tmp_path / "other", rank=0, tensorboard=False).write_thumbnails(
        "/videos/v0.mp4", [np.zeros((4, 4, 3), np.uint8)], [0.0]
    )  # every rank gets the key it would store in GroupRecord.media_key


def test_tensorboard_events(tmp_path):
    run = tmp_path / "run"
    w = write_run(run, steps=[1], tensorboard=True)
    w.log_eval(1, {"miou": 0.5})
    w.close()
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_records_validate():
    with pytest.raises(ValueError, match="finish_reason"):
        ResponseRecord(text="", parsed_span=None, rewards={}, advantage=0.0, length=0, finish_reason="eos")
    with pytest.raises(ValueError, match="gt_span"):
        GroupRecord(step=0, group_index=0, sample_id="a", video="v", duration=1.0, query="q", gt_span=[1.0])
    g = make_groups(3)[1]
    assert GroupRecord.from_json(json.loads(json.dumps(g.to_json()))) == g


def test_import_stays_light():
    heavy = "('torch', 'transformers', 'mmpg.train', 'mmpg.rl')"
    code = f"import sys, mmpg.runs; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
