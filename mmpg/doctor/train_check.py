"""The training row of `mmpg doctor`: three GRPO steps of `mmpg train` in bf16 (a fresh process, as a user starts it,
DeepSpeed in one process) on a tiny Qwen2.5-VL built here and a few synthetic videos rendered here, with the
grouped forward's self-check on (`algorithm.self_check=on`: the first step's grouped logprobs against the repeated
forward's, within the bf16 bound of `mmpg.grouping.selfcheck`).

PASS: the run exits 0, logs every step, its self-check figure is within its bound and no drift alarm fired
(`alarm/logprob_drift`: the rollout's logprobs against the training forward's). The figure gives the self-check's
max |dlogp| and bound, the largest rollout-vs-training gap, the mean seconds per step and what the run's fast paths
chose (run.json "fast_paths": the grouped backend, the decode kernel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mmpg.doctor.results import Row

STEPS = 3


def build_world(work: Path) -> tuple[Path, Path]:
    """(tiny Qwen2.5-VL checkpoint, synthetic dataset folder) under `work`, built once."""
    from mmpg.toy.models import make_tiny
    from mmpg.toy.videos import generate_dataset

    model, synth = work / "tiny-qwen2_5_vl", work / "synth"
    if not (model / "config.json").exists():
        make_tiny("qwen2_5_vl", model, overwrite=True)
    if not (synth / "train.json").exists():
        generate_dataset(synth, 6, 0, overwrite=True, min_duration=8.0, max_duration=10.0)
    return model, synth


def train_args(model: Path, synth: Path, out: Path, device: str) -> list[str]:
    sizes = {"data.batch_size": 2, "rollout.n": 4, "rollout.max_new_tokens": 8, "trainer.micro_batch_size": 8}
    if device == "cuda":
        sizes = {"data.batch_size": 4, "rollout.n": 8, "rollout.max_new_tokens": 32, "trainer.micro_batch_size": 16}
    args = {"model.path": model, "model.dtype": "bfloat16", "data.train": synth / "train.json",
            "data.videos": synth / "videos", "data.fps": 1.0, "data.max_frames": 4, "data.min_pixels": 3136,
            "data.max_pixels": 3136, "data.num_workers": 0, **sizes, "trainer.device": device,
            "trainer.output_dir": out, "trainer.run_name": "bf16", "trainer.total_steps": STEPS,
            "algorithm.self_check": "on", "optim.lr": 1e-4, "checkpoint.every_n_steps": 0,
            "logging.tensorboard": False}
    return [f"{k}={v}" for k, v in args.items()]


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return out


def fast_paths(run: Path) -> str:
    """"; grouped_backend sdpa, decode_kernel sdpa": what the run's fast paths chose (run.json "fast_paths")."""
    try:
        fast = json.loads((run / "run.json").read_text()).get("fast_paths") or {}
    except (OSError, ValueError):
        return ""
    return "".join(f"; {key} {entry.get('value')}" for key, entry in sorted(fast.items()) if isinstance(entry, dict))


def judge(metrics: list[dict], rc: int, log_tail: str) -> tuple[str, str, str]:
    """(status, figure, detail) of a finished run from its metrics.jsonl records and exit status."""
    checked = [m for m in metrics if "check/grouped_vs_repeated_max" in m]
    figure = ""
    if checked:
        figure = (f"self-check max abs dlogp {max(m['check/grouped_vs_repeated_max'] for m in checked):.2g} "
                  f"(bound {checked[0].get('check/bound', float('nan')):.2g}); ")
    if metrics:
        gap = max(m.get("actor/logprob_gap_max", 0.0) for m in metrics)
        step_s = sum(m.get("timing_s/step", 0.0) for m in metrics) / len(metrics)
        figure += f"rollout-vs-training gap {gap:.2g}; {len(metrics)}/{STEPS} steps, {step_s:.1f} s/step"
    problems = []
    if rc != 0:
        problems.append(f"mmpg train exited {rc}: {log_tail}")
    if len(metrics) < STEPS:
        problems.append(f"{len(metrics)} of {STEPS} steps logged")
    if not checked:
        problems.append("no step ran the self-check")
    elif any(m["check/grouped_vs_repeated_max"] > m.get("check/bound", float("inf")) for m in checked):
        problems.append("the self-check's figure is above its bound")
    if any(m.get("alarm/logprob_drift") for m in metrics):
        problems.append("the drift alarm fired")
    return ("FAIL" if problems else "PASS"), figure, "; ".join(problems)


def train_row(work: Path, device: str, timeout_s: float = 600) -> Row:
    row_id = "train/bf16"
    what = f"mmpg train: {STEPS} GRPO steps in bf16 with the self-check, tiny Qwen2.5-VL ({device})"
    t0 = time.perf_counter()
    model, synth = build_world(work)
    out = work / "runs"
    env = dict(os.environ, FORCE_QWENVL_VIDEO_READER="decord", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "mmpg.cli", "train", *train_args(model, synth, out, device)]
    if os.environ.get("MMPG_DOCTOR_FAULT", "").startswith("train"):
        cmd.append("trainer.total_steps=1")  # the fault a test injects here: a run that stops short
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        rc, tail = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1][:240]
    except subprocess.TimeoutExpired:
        rc, tail = 124, f"stopped after {timeout_s:.0f} s"
    (work / "train.log").write_text(f"$ {' '.join(cmd)}\nexit {rc}\n{tail}\n")
    status, figure, detail = judge(_metrics(out / "bf16"), rc, tail)
    figure += fast_paths(out / "bf16")
    return Row("train", row_id, what, status, figure, detail, time.perf_counter() - t0)
