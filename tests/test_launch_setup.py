"""What a launch sets up on a machine that cannot run flash-attn (fast, no build): scripts/flash_attn.sh's decision
(extras gpu-auto / gpu) against a stand-in machine, and the attention transformers is asked to load.

The stand-in machine: a `python` wrapper that answers the script's three questions (flash_attn installed? torch's
CUDA? pip's result) from environment variables and passes anything else to this interpreter; nvidia-smi and nvcc
stand-ins on a PATH without the real ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COST = "the grouped forward and model.attn_implementation=auto run on sdpa"

PYTHON = f"""#!/bin/sh
echo "$*" >> "$CALLS"
case "$*" in
  *'m.version("flash_attn")'*) [ -n "$FAKE_FLASH_INSTALLED" ] && exit 0; exit 1 ;;
  *torch.version.cuda*) echo "$FAKE_TORCH_CUDA"; exit 0 ;;
  "-m pip install --no-build-isolation"*)
    if [ -n "$FAKE_PIP_FAILS" ]; then
      i=0; while [ $i -lt 300 ]; do echo "  compiling kernel $i"; i=$((i + 1)); done
      echo "  error: subprocess-exited-with-error"
      echo "  csrc/flash_api.cpp:1:10: fatal error: cuda_runtime.h: No such file or directory"
      exit 1
    fi
    exit 0 ;;
  "-m pip"*) exit 0 ;;
esac
exec {sys.executable} "$@"
"""


class Machine:
    """A repository root with a venv python stand-in; `run(mode)` runs scripts/flash_attn.sh there."""

    def __init__(self, tmp_path: Path):
        self.root, self.bin = tmp_path / "repo", tmp_path / "bin"
        self.python = self.root / ".venv" / "bin" / "python"
        self.python.parent.mkdir(parents=True)
        self.bin.mkdir()
        self.python.write_text(PYTHON)
        self.python.chmod(0o755)
        self.calls = tmp_path / "calls"
        self.env = {"FAKE_TORCH_CUDA": "12.8"}

    def tool(self, name: str, output: str) -> None:
        (self.bin / name).write_text(f"#!/bin/sh\necho '{output}'\n")
        (self.bin / name).chmod(0o755)

    def run(self, mode: str):
        self.calls.write_text("")
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "MMPG_ROOT": str(self.root),
               "CUDA_HOME": str(self.root / "no-cuda"), "CALLS": str(self.calls), **self.env}
        res = subprocess.run(["bash", str(ROOT / "scripts" / "flash_attn.sh"), mode, str(self.python)], env=env,
                             capture_output=True, text=True, timeout=120, check=False)
        return res, self.calls.read_text()


def _skip_line(res) -> str:
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr  # one line, not a build log
    assert lines[0].startswith("[mmpg] flash-attn skipped: ") and lines[0].endswith(
        "(same results; on GPUs slower, more memory)") and COST in lines[0], lines[0]
    return lines[0]


def test_auto_skips_with_one_line_stamps_it_and_retries_when_the_machine_changes(tmp_path):
    m = Machine(tmp_path)
    res, calls = m.run("auto")
    assert res.returncode == 0 and "no GPU visible" in _skip_line(res)
    assert "pip" not in calls and "torch.version.cuda" in calls
    res, calls = m.run("auto")  # stamped: the same line, nothing probed or built again
    assert res.returncode == 0 and "no GPU visible" in _skip_line(res) and "torch.version.cuda" not in calls
    m.tool("nvidia-smi", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)")
    m.tool("nvcc", "Cuda compilation tools, release 11.8, V11.8.89")
    res, calls = m.run("auto")  # a GPU appeared: asked again
    assert "nvcc 11.8" in _skip_line(res) and "does not match torch's CUDA 12.8" in res.stderr and "pip" not in calls
    m.tool("nvcc", "Cuda compilation tools, release 12.4, V12.4.131")
    m.env["FAKE_PIP_FAILS"] = "1"
    res, calls = m.run("auto")  # now a build can work: tried, failed, one line and the log
    log = m.root / ".cache" / "flash-attn-build.log"
    line = _skip_line(res)
    assert res.returncode == 0 and "--no-build-isolation" in calls
    assert f"the build failed (csrc/flash_api.cpp:1:10: fatal error: cuda_runtime.h: No such file or directory; " \
           f"log {log})" in line
    assert len(log.read_text().splitlines()) > 300
    res, calls = m.run("auto")
    assert "the build failed" in _skip_line(res) and "pip" not in calls  # not rebuilt on every launch


def test_auto_on_a_cpu_torch_and_with_flash_attn_installed(tmp_path):
    m = Machine(tmp_path)
    m.tool("nvidia-smi", "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-0)")
    m.env["FAKE_TORCH_CUDA"] = ""
    res, _ = m.run("auto")
    assert "is a CPU build" in _skip_line(res)
    m.env["FAKE_FLASH_INSTALLED"] = "1"
    for mode in ("auto", "must"):
        res, calls = m.run(mode)
        assert (res.returncode, res.stderr, calls.count("\n")) == (0, "", 1)  # one metadata look-up, nothing else


def test_a_wheel_in_wheels_is_installed_without_a_gpu(tmp_path):
    m = Machine(tmp_path)
    (m.root / "wheels").mkdir()
    (m.root / "wheels" / "flash_attn-2.8.3-cp311-cp311-linux_x86_64.whl").write_text("")
    res, calls = m.run("auto")
    assert res.returncode == 0 and res.stderr == ""
    assert f"--find-links {m.root / 'wheels'} --prefer-binary flash-attn>=2.7" in calls


def test_must_stops_with_the_reason_and_the_log_path_in_one_line(tmp_path):
    m = Machine(tmp_path)
    m.env["FAKE_PIP_FAILS"] = "1"
    res, calls = m.run("must")  # tried even though no GPU is visible (a GPU-less image build is legitimate)
    assert res.returncode == 1 and "--no-build-isolation" in calls
    (line,) = res.stderr.splitlines()
    assert line.startswith("[mmpg] flash-attn (extra gpu) failed to install: no GPU visible (nvidia-smi -L lists none)")
    assert "first error: csrc/flash_api.cpp:1:10: fatal error: cuda_runtime.h" in line
    assert f"full log: {m.root / '.cache' / 'flash-attn-build.log'}" in line and "MMPG_EXTRAS=dev,gpu-auto" in line


def test_attention_auto_and_the_flash_fallback(monkeypatch, caplog):
    from mmpg.models.loading import resolve_attn_implementation

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` fails, as without the package
    with caplog.at_level("WARNING", logger="mmpg.models"):
        assert resolve_attn_implementation("auto", "cpu") == "sdpa"
        assert resolve_attn_implementation("auto", "cuda") == "sdpa"
        assert resolve_attn_implementation("eager", "cpu") == "eager"
        assert resolve_attn_implementation("sdpa", "cuda") == "sdpa"
        assert not caplog.records  # auto and the others choose silently
        assert resolve_attn_implementation("flash_attention_2", "cuda") == "sdpa"
    (record,) = caplog.records
    assert "flash_attention_2, but flash-attn does not import (ModuleNotFoundError" in record.getMessage()
    assert "loading with sdpa instead" in record.getMessage()


@pytest.fixture
def fake_flash(monkeypatch):
    from flash_standin import standin_flash_attn

    yield from standin_flash_attn(monkeypatch)


def test_attention_auto_takes_flash_where_it_imports(fake_flash, monkeypatch):
    """With flash-attn importable (tests/fake_flash_attn) and transformers agreeing, on CUDA: flash_attention_2."""
    import transformers.utils

    from mmpg.models.loading import resolve_attn_implementation

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert resolve_attn_implementation("auto", "cuda") == "flash_attention_2"
    assert resolve_attn_implementation("flash_attention_2", "cuda:1") == "flash_attention_2"
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"  # a CPU run never asks for a CUDA kernel
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert resolve_attn_implementation("auto", "cuda") == "sdpa"


@pytest.mark.parametrize("config", ["configs/grounding_qwen25vl_7b.yaml", "configs/grounding_qwen3vl_8b.yaml"])
def test_the_gpu_configs_ask_for_auto(config):
    from mmpg.config import load_config

    assert load_config(config, []).model.attn_implementation == "auto"
