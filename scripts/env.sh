#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv/ at the repository root and install mmpg into it.
# Idempotent and fast when nothing changed: a stamp records the hash of pyproject.toml and the extras installed.
# Usage: source scripts/env.sh [extras]      (extras default: dev; e.g. "dev,gpu" on a CUDA machine: gpu = flash-attn,
#        built against the installed torch, see below)
set -euo pipefail
MMPG_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$MMPG_ROOT/.venv"
_extras="${1:-dev}"
# torch first and pinned: on our machines pip takes these builds from local disk; a bare "torch" would pull a
# different multi-GB build. Override for other platforms, e.g. MMPG_TORCH="torch==2.9.1 torchvision==0.24.1".
_torch="${MMPG_TORCH:-torch==2.14.1 torchvision==0.29.1}"
_want="$(cat "$MMPG_ROOT/pyproject.toml" | sha256sum | cut -c1-16) $_extras $_torch"
[ -x "$_venv/bin/python" ] || python3 -m venv "$_venv"
if [ "$(cat "$_venv/.mmpg-installed" 2>/dev/null)" != "$_want" ]; then
  echo "[mmpg] installing into .venv (first time takes a few minutes) ..."
  "$_venv/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$_venv/bin/python" -m pip install -q $_torch
  # The gpu extra is flash-attn, whose sdist imports torch in setup.py and has no pyproject.toml: inside pip's build
  # isolation there is no torch (ModuleNotFoundError). So mmpg goes in without it, and flash-attn after torch with
  # --no-build-isolation (a source build needs nvcc of torch's CUDA major; FLASH_ATTN_CUDA_ARCHS, e.g. "80;90",
  # limits the architectures it compiles). A failure stops here, loudly: scripts/gpu_check.sh would report the
  # flash path NOT RUN anyway.
  _pip_extras="$(echo ",$_extras," | sed 's/,gpu,/,/g; s/^,//; s/,$//')"
  "$_venv/bin/python" -m pip install -q -e "$MMPG_ROOT${_pip_extras:+[$_pip_extras]}"
  if [[ ",$_extras," == *",gpu,"* ]]; then
    "$_venv/bin/python" -m pip install -q packaging psutil ninja wheel setuptools
    "$_venv/bin/python" -m pip install -q --no-build-isolation "flash-attn>=2.7"
  fi
  echo "$_want" > "$_venv/.mmpg-installed"
fi
export PATH="$_venv/bin:$PATH"
# qwen-vl-utils: decord is the reader that works with our torchvision (its torchvision reader does not).
export FORCE_QWENVL_VIDEO_READER=decord
export TOKENIZERS_PARALLELISM=false
# DeepSpeed compiles ops on first use; keep them between runs.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$MMPG_ROOT/.cache/torch_extensions}"
