"""scripts/train_grounding.sh's vLLM knobs on a CPU, with a stand-in DeepSpeed launcher and a stand-in server (the
real ones need GPUs): which flags each gets, the server's GPUs, and the server stopped when training ends."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, extra_env: dict, *args: str, trainer_rc: int = 0):
    """(completed process, trainer argv, server argv + its CUDA_VISIBLE_DEVICES, server pid)."""
    trainer = tmp_path / "deepspeed"
    trainer.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/trainer.args\nsleep 1\nexit {trainer_rc}\n')
    server = tmp_path / "serve"
    server.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/server.args\necho "${{CUDA_VISIBLE_DEVICES:-unset}}" > '
                      f'{tmp_path}/server.gpus\necho $$ > {tmp_path}/server.pid\nexec sleep 300\n')
    trainer.chmod(0o755)
    server.chmod(0o755)
    env = dict(os.environ, MMPG_EXTRAS="dev", MMPG_DEEPSPEED=str(trainer), MMPG_VLLM_SERVE=str(server), VLLM="1",
               **extra_env)
    res = subprocess.run(["bash", "scripts/train_grounding.sh", "configs/cpu_demo.yaml", "model.path=/models/q25",
                          *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    read = lambda name: (tmp_path / name).read_text().strip() if (tmp_path / name).exists() else None
    return res, read("trainer.args"), (read("server.args"), read("server.gpus")), read("server.pid")


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    return True


def test_colocated_server_gets_the_model_and_stops_with_training(tmp_path):
    res, trainer, (server, gpus), pid = _run(tmp_path, {}, "trainer.total_steps=3", trainer_rc=7)
    assert res.returncode == 7, res.stderr  # the trainer's status is the script's
    assert trainer.endswith("--module mmpg.cli train --config configs/cpu_demo.yaml model.path=/models/q25 "
                            "trainer.total_steps=3 rollout.engine=vllm rollout.vllm_url=http://127.0.0.1:8000")
    assert server == "--checkpoint /models/q25 --port 8000 --gpu-memory-utilization 0.3" and gpus == "unset"
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the server outlived the training"


def test_own_gpus_port_and_extra_flags(tmp_path):
    res, trainer, (server, gpus), _ = _run(tmp_path, {"VLLM_GPUS": "3", "TRAIN_GPUS": "0,1,2", "VLLM_PORT": "8123",
                                                      "VLLM_ARGS": "--max-model-len 16384"})
    assert res.returncode == 0, res.stderr
    assert trainer.startswith("--include localhost:0,1,2 --module mmpg.cli train")
    assert trainer.endswith("rollout.vllm_url=http://127.0.0.1:8123")
    assert server == "--checkpoint /models/q25 --port 8123 --max-model-len 16384" and gpus == "3"


@pytest.mark.parametrize("env, message", [({"HOSTFILE": "hosts"}, "one node"),
                                          ({"NUM_GPUS": "2", "TRAIN_GPUS": "0"}, "not both")])
def test_refusals(tmp_path, env, message):
    res, trainer, (server, _), _ = _run(tmp_path, env)
    assert res.returncode == 2 and message in res.stderr
    assert trainer is None and server is None


def test_get_prints_one_resolved_field():
    def get(*argv):
        res = subprocess.run(["mmpg", "train", "--config", "configs/cpu_demo.yaml", *argv], check=False, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        return res.returncode, res.stdout.strip(), res.stderr

    assert get("model.path=/m/x", "--get", "model.path")[:2] == (0, "/m/x")
    rc, _, err = get("--get", "model.nope")
    assert rc == 2 and "no config field 'nope'" in err
