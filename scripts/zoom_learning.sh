#!/usr/bin/env bash
# Does zooming beat one look at an equal frame budget? The toy zoom task's two arms (SFT then GRPO each, a tiny
# Qwen3-VL), each stage evaluated on the held-out test videos; prints one table (mmpg/toy/demo/zoom_learning.py says
# what each arm runs). Run it again after a stop: finished stages are reused, a stopped one continues.
#   bash scripts/zoom_learning.sh [--unlisted-steps 500] [--clip-steps 0] [--answer-steps 0] [--sft-steps 4500]
#                                 [--grpo-steps 80] [--test-samples 0] [--seed 0] [--workdir DIR] [--arm both|zoom|one_look]
#   bash scripts/zoom_learning.sh --readout CHECKPOINT ...   (a zoom checkpoint's answer readout, nothing trained)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
exec python -m mmpg.toy.demo.zoom_learning "$@"
