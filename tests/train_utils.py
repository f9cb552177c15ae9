"""Building training configs for tests: the tiny model, a few synthetic videos, one small step size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from forked_cli import WarmProcess
from mmpg.serve.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def overrides(data: dict, out: Path, name: str, **extra) -> list[str]:
    """key=value overrides for a short CPU GRPO run; `extra` adds or replaces ('rollout.n': 4, ...)."""
    synth = data["synth"]
    base = {
        "model.path": data["model"], "model.dtype": "float32",
        "data.train": str(synth / "train.json"), "data.videos": str(synth / "videos"),
        "data.batch_size": 2, "data.fps": 1.0, "data.max_frames": 4, "data.min_pixels": 3136,
        "data.max_pixels": 3136, "data.num_workers": 0,
        "rollout.n": 4, "rollout.max_new_tokens": 8,
        "trainer.micro_batch_size": 4, "trainer.device": "cpu", "trainer.output_dir": str(out),
        "trainer.run_name": name, "trainer.total_steps": 3, "trainer.seed": 0,
        "optim.lr": 1e-3, "checkpoint.every_n_steps": 0, "logging.tensorboard": False,
        "reward.function": "reward_fns:digit_share",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), e.get("PYTHONPATH", "")])
    e.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")
    e.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    e["OMP_NUM_THREADS"] = e.get("OMP_NUM_THREADS", "1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


def run_cli(args: list[str], timeout: float = 600, procs: int = 1, fresh: bool = False, environ: dict | None = None
            ) -> subprocess.CompletedProcess:
    """`mmpg ...` as its own process (`procs` ranks of one run when > 1), forked from the worker's warm process
    (tests/forked_cli.py); `fresh=True`: a cold `python -m mmpg.cli` (under torchrun when procs > 1), for tests about
    what a cold start or the launcher itself does. `environ`: the run's whole environment (default `env()`)."""
    environ = env() if environ is None else environ
    if not fresh:
        return _warm_process().run(args, environ, ROOT, timeout, procs)
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port",
               str(free_port()), "-m", "mmpg.cli"] + args
    else:
        cmd = [sys.executable, "-m", "mmpg.cli"] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environ, cwd=ROOT)


_warm = None


def _warm_process() -> WarmProcess:
    """This test process's warm process, started on first use."""
    global _warm
    if _warm is None:
        _warm = WarmProcess(env())
    return _warm


def run_forked(target: str, argv: list[str], procs: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """`target(argv)` (a tests/ module's `module:function`) in `procs` forked ranks, torchrun's environment each."""
    return _warm_process().run(argv, env(), ROOT / "tests", timeout, procs, target=target)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))
