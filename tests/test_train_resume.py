"""Resume after SIGKILL: the resumed run ends at the same step with the same metrics and rollouts as a run that was
never interrupted; no step is lost or repeated; a half-written checkpoint and a half-written line are ignored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from train_utils import ROOT, env, metrics, overrides, run_cli

pytestmark = pytest.mark.slow

STEPS = 8
# wall-clock figures differ between any two runs; the self-check's figures (check/*) appear on the first step of
# every process, so also on the first step after a resume (a resumed run may run in another environment)
VOLATILE = ("time", "timing_s/", "perf/", "check/")


def _args(grpo_data, out, name):
    return ["train"] + overrides(grpo_data, out, name, **{
        "trainer.total_steps": STEPS, "checkpoint.every_n_steps": 2, "checkpoint.keep_last": 2,
        "reward.function": "reward_fns:space_share", "data.num_workers": 1, "optim.lr": 1e-2,
        "optim.scheduler": "cosine", "optim.warmup_steps": 2})


def _stable(line: dict) -> dict:
    return {k: v for k, v in line.items() if not k.startswith(VOLATILE)}


def _rollouts(run_dir) -> dict:
    out = {}
    for path in sorted((run_dir / "rollouts").glob("step_*.jsonl")):
        out[path.name] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _kill_after_step(args, run_dir, step: int, timeout: float = 600):
    """Start a run and SIGKILL it as soon as the metrics line of `step` exists."""
    proc = subprocess.Popen([sys.executable, "-m", "mmpg.cli"] + args, env=env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            path = run_dir / "metrics.jsonl"
            if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines()
                                     if line.endswith("}")):
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)
                return
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError("timed out waiting for the run")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigkill_then_resume_auto_matches_an_uninterrupted_run(grpo_data, tmp_path):
    proc = run_cli(_args(grpo_data, tmp_path, "straight"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "killed"
    _kill_after_step(_args(grpo_data, tmp_path, "killed"), run, 5)
    done = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert done[-1] < STEPS
    # what a kill in the middle of writing leaves: a half-written checkpoint folder and a half-written line
    half = run / "checkpoints" / ".tmp-step_00000006"
    half.mkdir(parents=True, exist_ok=True)
    (half / "model.safetensors").write_bytes(b"\x00" * 100)
    incomplete = run / "checkpoints" / "step_00000006"  # a final name without COMPLETE is not a checkpoint either
    incomplete.mkdir(exist_ok=True)
    (incomplete / "trainer_state.json").write_text('{"step": 6}')
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"v": 1, "step": 99, "reward/me')

    proc = run_cli(_args(grpo_data, tmp_path, "killed")[:1] + ["--resume", "auto"] + _args(grpo_data, tmp_path,
                                                                                             "killed")[1:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step_00000004" in proc.stderr

    straight, resumed = metrics(tmp_path / "straight"), metrics(run)
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1)), "a step was lost or repeated"
    for a, b in zip(straight, resumed):
        assert _stable(a) == _stable(b), a["step"]
    assert _rollouts(tmp_path / "straight") == _rollouts(run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
    assert (run / "checkpoints" / "step_00000006" / "COMPLETE").is_file()


def test_resume_flag_and_nothing_to_resume(grpo_data, tmp_path):
    """--resume auto on a fresh name starts a new run; --resume PATH of a folder that is no checkpoint is one line."""
    args = ["train"] + overrides(grpo_data, tmp_path, "fresh", **{"trainer.total_steps": 1})
    proc = run_cli(args + ["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in metrics(tmp_path / "fresh")] == [1]
    proc = run_cli(["train"] + overrides(grpo_data, tmp_path, "other") + ["--resume", str(tmp_path)])
    assert proc.returncode == 2 and "not a complete mmpg checkpoint" in proc.stderr
