#!/usr/bin/env bash
# One GPU, about 5 minutes: the `gpu`-marked equivalence tests (flash and flex backends, bf16 and fp32), then a short
# benchmark at P = 16K, S = 512, G = 16 (attention with Qwen2.5-VL-3B's heads; a Qwen2.5-VL-3B-sized random-weight
# LM, bf16, gradient checkpointing), printing the bench table. Logs and JSON go to $OUT when it is set (the GPU runner
# collects it), else runs/bench/. flash-attn may fail to build: its tests then skip and the script goes on.
#   bash scripts/gpu_check.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/runs/bench}"
mkdir -p "$out"
stamp="$(date +%Y%m%d-%H%M%S)"
log="$out/gpu_check-$stamp.log"
say() { echo "[gpu_check] $*" | tee -a "$log"; }

# 1. environment: dev + gpu extras (flash-attn); on failure dev alone; on failure the .venv as it is
if ! timeout 150 bash -c 'source scripts/env.sh dev,gpu' >>"$log" 2>&1; then
  say "installing dev,gpu failed or timed out (flash-attn build?); trying dev"
  timeout 120 bash -c 'source scripts/env.sh dev' >>"$log" 2>&1 || say "installing dev failed; using .venv as it is"
fi
export PATH="$root/.venv/bin:$PATH" FORCE_QWENVL_VIDEO_READER=decord TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python - <<'PY' 2>&1 | tee -a "$log"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except ImportError as err:
    print("flash_attn not importable:", err)
PY

# 2. equivalence on the GPU (a failure is reported and the benchmark still runs; the exit status keeps it)
status=0
timeout 120 python -m pytest -m gpu tests/ -q -p no:cacheprovider -rs 2>&1 | tee -a "$log" || status=$?
say "gpu tests exit status: $status"

# 3. the short benchmark: one round, two timed steps per variant (the repeated baseline may report OOM)
timeout 240 python -m mmpg.bench.cli --preset gpu --rounds 1 --repeats 2 --warmup 1 --timeout 200 \
  --out "$out/bench-gpu-$stamp.json" 2>&1 | tee -a "$log" || { s=$?; say "bench exit status: $s"; status=$s; }
say "done: $log"
exit "$status"
