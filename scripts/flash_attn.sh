#!/usr/bin/env bash
# Installs flash-attn into .venv after torch. Called by scripts/env.sh for the extras gpu and gpu-auto; not meant to
# be run by hand.   bash scripts/flash_attn.sh must|auto VENV_PYTHON      (MMPG_ROOT from the environment)
#   must (extra gpu):      always tried; a failure is one line (the reason, the build log's path) and exit 1.
#   auto (extra gpu-auto): tried only where it can work: a flash_attn wheel in wheels/, or a CUDA torch, a GPU
#                          (nvidia-smi -L) and nvcc of torch's CUDA major to build it. Otherwise, or when that fails,
#                          one line says why and what it costs, exit 0: training runs on sdpa.
# A skip is stamped with a fingerprint of what decides it (GPUs, nvcc, wheels/, torch): later launches print the
# stamped line instead of retrying, and retry when the fingerprint changes (a wheel added, a GPU, another nvcc).
# --no-build-isolation: flash-attn's setup.py imports torch, which pip's isolated build environment lacks. A source
# build compiles for the architectures in FLASH_ATTN_CUDA_ARCHS (e.g. "80;90"); minutes to an hour.
set -euo pipefail
mode="${1:?must or auto}"; py="${2:?the venv python}"; : "${MMPG_ROOT:?}"
stamp="$(dirname "$py")/../.mmpg-flash-attn"
log="$MMPG_ROOT/.cache/flash-attn-build.log"
cost="the grouped forward and model.attn_implementation=auto run on sdpa (same results; on GPUs slower, more memory)"
# already there: metadata only (importing flash_attn would import torch, seconds on every launch)
"$py" -c 'import importlib.metadata as m; m.version("flash_attn")' 2>/dev/null && exit 0

shopt -s nullglob
wheels=("$MMPG_ROOT"/wheels/flash_attn-*.whl)
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
nvcc="$(command -v nvcc || ls "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" 2>/dev/null || true)"
nvcc_cuda="$([ -n "$nvcc" ] && "$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p' || true)"
torch_version="$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))')"
fingerprint="$(printf '%s|' "$(nvidia-smi -L 2>/dev/null || true)" "$nvcc $nvcc_cuda" "${wheels[*]}" "$torch_version" \
  | sha256sum | cut -c1-16)"

skip() {  # one line, stamped for this fingerprint
  printf '%s\n%s\n' "$fingerprint" "$1" > "$stamp"
  echo "[mmpg] flash-attn skipped: $1; $cost" >&2
  exit 0
}
if [ "$mode" = auto ] && [ "$(head -1 "$stamp" 2>/dev/null)" = "$fingerprint" ]; then skip "$(sed -n 2p "$stamp")"; fi

why_not=""  # why a build cannot work here (empty: try)
if [ ${#wheels[@]} -eq 0 ]; then
  torch_cuda="$("$py" -c 'import torch; print(torch.version.cuda or "")')"
  # each reason says what would let it work: a toolkit of torch's CUDA major, or a wheel built for this torch
  wheel="or put a flash_attn wheel built for torch $torch_version in wheels/"
  if [ -z "$torch_cuda" ]; then why_not="torch $torch_version is a CPU build (scripts/env.sh installs a CUDA build"
    why_not+=" for the NVIDIA driver unless MMPG_TORCH says otherwise)"
  elif [ "$gpus" = 0 ]; then why_not="no GPU visible (nvidia-smi -L lists none)"
  elif [ -z "$nvcc" ]; then
    why_not="no nvcc to build it (PATH, CUDA_HOME): install the CUDA ${torch_cuda%%.*}.x toolkit and set CUDA_HOME,"
    why_not+=" $wheel"
  elif [ "${nvcc_cuda%%.*}" != "${torch_cuda%%.*}" ]; then
    why_not="nvcc $nvcc_cuda ($nvcc) does not match torch's CUDA $torch_cuda: install the CUDA ${torch_cuda%%.*}.x"
    why_not+=" toolkit and set CUDA_HOME to it (nvcc and torch must share the CUDA major), $wheel"
  fi
fi
[ "$mode" = auto ] && [ -n "$why_not" ] && skip "$why_not"

mkdir -p "$(dirname "$log")"
links=()
[ -d "$MMPG_ROOT/wheels" ] && links=(--find-links "$MMPG_ROOT/wheels" --prefer-binary)
echo "[mmpg] installing flash-attn (${wheels[*]:-a source build: minutes to an hour; log $log}) ..."
if { "$py" -m pip install packaging psutil ninja wheel setuptools \
     && "$py" -m pip install --no-build-isolation "${links[@]}" "flash-attn>=2.7"; } >"$log" 2>&1; then
  rm -f "$stamp"
  exit 0
fi
# the compiler's or pip's first real error, not pip's "subprocess-exited-with-error" wrapper
first="$(grep -E 'fatal error:|error: |Error: |ERROR: ' "$log" | grep -v 'subprocess-exited-with-error' | head -1 \
  | sed 's/^[[:space:]]*//; s#^/.*/site-packages/##' | cut -c1-200 || true)"
[ "$mode" = auto ] && skip "the build failed (${first:-see the log}; log $log)"
echo "[mmpg] flash-attn (extra gpu) failed to install${why_not:+: $why_not}; first error: ${first:-none found}; full" \
     "log: $log. Fix that, or launch with MMPG_EXTRAS=dev,gpu-auto to train without it (sdpa)" >&2
exit 1
