#!/usr/bin/env bash
# A short GRPO run on a CPU, one process, a few minutes: the tiny Qwen2.5-VL and synthetic videos are built once under
# data/generated/demo/, then `mmpg train --config configs/cpu_demo.yaml` runs on the same code path as a GPU job.
#   bash scripts/train_cpu_demo.sh [key=value ...]      e.g. trainer.total_steps=20 rollout.n=8
# The run directory is printed at the end (runs/cpu-demo-<time> by default).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
work=data/generated/demo
[ -f "$work/tiny-qwen2_5_vl/config.json" ] || mmpg make-tiny --family qwen2_5_vl --out "$work/tiny-qwen2_5_vl" --overwrite
[ -f "$work/synth/train.json" ] || mmpg synth --out "$work/synth" --n 24 --min-duration 8 --max-duration 20 --overwrite
exec mmpg train --config configs/cpu_demo.yaml trainer.run_name="cpu-demo-$(date +%Y%m%d-%H%M%S)" "$@"
