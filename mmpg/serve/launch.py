"""Starting the vLLM server from the trainer's venv: `mmpg vllm-serve` re-executes itself in .venv-vllm.

The trainer's interpreter never imports vllm (its pins conflict with the trainer's transformers); it only finds the
server venv's python: $MMPG_VLLM_PYTHON, else REPO/.venv-vllm/bin/python (made by `scripts/env.sh vllm`).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mmpg.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULE = "mmpg.serve.vllm_server"


def vllm_python() -> str | None:
    """The python of the vLLM venv, or None when there is none. `.venv-vllm` counts only once `scripts/env.sh vllm`
    has stamped it ready (`.mmpg-installed`): a half-made one (a failed install) is no environment."""
    env = os.environ.get("MMPG_VLLM_PYTHON")
    if env:
        return env if os.access(env, os.X_OK) else None
    path = ROOT / ".venv-vllm" / "bin" / "python"
    ready = (ROOT / ".venv-vllm" / ".mmpg-installed").is_file()
    return str(path) if ready and os.access(path, os.X_OK) else None


def serve(argv: list[str]) -> int:
    """Run the server with these flags: here when this interpreter has vllm, else exec'ed in .venv-vllm."""
    if importlib.util.find_spec("vllm") is not None:  # already in the server's venv
        from mmpg.serve.vllm_server import main

        return main(argv)
    python = vllm_python()
    if python is None:
        raise UserError("no vLLM environment: run `bash scripts/env.sh vllm` (makes .venv-vllm) or point "
                        "MMPG_VLLM_PYTHON at a python that has vllm")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    sys.stdout.flush()
    os.execve(python, [python, "-m", SERVER_MODULE, *argv], env)
    return 0  # not reached


class ServerStartError(RuntimeError):
    """The server process died or did not answer /health in time. The message's first line (`line`) says why, with
    the log's last lines and its path; the lines after it are the log's tail."""

    @property
    def line(self) -> str:
        return str(self).splitlines()[0] if str(self) else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `mmpg vllm-serve` child process on 127.0.0.1 with its output in a log file; vLLM's engine processes share
    its process group, so `stop` ends them too. Used by the bench's vllm variant and the vllm tests (a user starts the
    server with scripts/vllm_serve.sh). eager: no torch.compile warm-up (minutes on 2 cores), the same kernels."""

    def __init__(self, checkpoint: str | Path, log_path: str | Path, *, port: int | None = None,
                 dtype: str = "float32", max_model_len: int = 1024, eager: bool = True, extra: tuple = (),
                 env: dict | None = None, python: str | None = None):
        python = python or vllm_python()
        if python is None:
            raise UserError("no vLLM environment: run `bash scripts/env.sh vllm` (makes .venv-vllm)")
        self.port = port or free_port()
        self.url, self.log_path = f"http://127.0.0.1:{self.port}", Path(log_path)
        self.cmd = [python, "-m", SERVER_MODULE, "--checkpoint", str(checkpoint), "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", dtype, "--max-model-len", str(max_model_len),
                    *(["--enforce-eager"] if eager else []), *extra]
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self.start()

    def start(self) -> None:
        with open(self.log_path, "a") as out:  # the child keeps its own handle
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                         start_new_session=True)

    def wait(self, timeout: float = 900.0) -> float:
        """Seconds until /health answers; ServerStartError (log tail and path) if it dies or is late (then stopped)."""
        from mmpg.serve.wire import ServerError, call

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise ServerStartError(self._why(f"vLLM server exited ({self.proc.returncode})"))
            try:
                call(self.url, "/health", timeout=5)
                return time.monotonic() - t0
            except ServerError:
                time.sleep(2)
        self.stop()
        raise ServerStartError(self._why(f"vLLM server not up after {timeout:.0f} s"))

    def _why(self, what: str) -> str:
        last = " | ".join(self.tail(3).splitlines())
        return f"{what}: {last} (log: {self.log_path})\n{self.tail()}"

    def restart(self) -> float:
        """Stop it and start a new one on the same port (it loads the checkpoint again); seconds until up."""
        self.stop()
        self.start()
        return self.wait()

    def tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-n:]) or "(empty log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server, which shuts vLLM's engine processes down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
