#!/usr/bin/env bash
# Does rollout/training overlap cost learning? The demo's GRPO stage on the vLLM engine, synchronous
# (rollout.max_staleness=0) beside overlapped (=1), same SFT warm start, steps and seed; prints both held-out test
# mIoUs (mmpg/toy/demo/async_learning.py says what differs from the demo). Needs .venv-vllm (bash scripts/env.sh vllm).
#   bash scripts/async_learning.sh [--grpo-steps 90] [--seed 0] [--sft-checkpoint DIR] [--workdir DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m mmpg.toy.demo.async_learning "$@"
