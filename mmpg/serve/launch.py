"""Starting the vLLM server from the trainer's venv: `mmpg vllm-serve` re-executes itself in .venv-vllm.

The trainer's interpreter never imports vllm (its pins conflict with the trainer's transformers); it only finds the
server venv's python: $MMPG_VLLM_PYTHON, else REPO/.venv-vllm/bin/python (made by `scripts/env.sh vllm`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
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
