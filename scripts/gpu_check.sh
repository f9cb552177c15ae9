#!/usr/bin/env bash
# Check a GPU machine before a run: `mmpg doctor` (every GPU path on tiny models against its exact reference,
# three bf16 training steps, a speed table; see `mmpg doctor --help`) under a time limit, its report in $OUT.
#   bash scripts/gpu_check.sh                 results in $OUT (default runs/doctor/<time>): doctor.md, doctor.json
#   bash scripts/gpu_check.sh --quick         without the training run and the speed table
#   MMPG_DOCTOR_LIMIT_S=1200 bash scripts/gpu_check.sh     the limit in seconds (default 900)
# Any other arguments go to `mmpg doctor`. Exit: mmpg doctor's (0 nothing failed, 1 a row failed: the last line
# names it), 124 when the limit stopped it.
# The vLLM engine's NCCL weight sync is checked when .venv-vllm exists (scripts/env.sh vllm) and two GPUs are there.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ -x "$root/.venv/bin/mmpg" ]; then mmpg="$root/.venv/bin/mmpg"; else mmpg="$(command -v mmpg)" || {
  echo "gpu_check: no mmpg command: source scripts/env.sh (or pip install mmpg) first" >&2; exit 2; }; fi
out="${OUT:-$root/runs/doctor/$(date +%Y%m%d-%H%M%S)}"
export FORCE_QWENVL_VIDEO_READER=decord TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
timeout -k 10 "${MMPG_DOCTOR_LIMIT_S:-900}" "$mmpg" doctor --out "$out" "$@"
rc=$?
[ "$rc" = 124 ] && echo "gpu_check: stopped at the ${MMPG_DOCTOR_LIMIT_S:-900} s limit; rows finished so far are above" >&2
exit "$rc"
