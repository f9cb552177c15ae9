#!/usr/bin/env bash
# The demo's two training stages by hand, on a CPU, one process each: the tiny Qwen2.5-VL and the easy synthetic
# videos are built once under data/generated/demo/, then a supervised warm start (configs/sft_cpu_demo.yaml, skipped
# when runs/sft-demo already has its step 200, continued from its last checkpoint when a run was stopped) and GRPO
# from it (configs/cpu_demo.yaml, a new run each time) on the same code path as a GPU job.
#   bash scripts/train_cpu_demo.sh [key=value ...]      GRPO overrides, e.g. trainer.total_steps=200 rollout.n=16
# The GRPO run directory is printed at the end (runs/cpu-demo-<time>).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
mmpg demo --build-only
sft=runs/sft-demo/checkpoints/step_00000200
[ -f "$sft/COMPLETE" ] || mmpg sft --config configs/sft_cpu_demo.yaml trainer.output_dir=runs trainer.run_name=sft-demo
exec mmpg train --config configs/cpu_demo.yaml model.path="$sft" trainer.run_name="cpu-demo-$(date +%Y%m%d-%H%M%S)" "$@"
