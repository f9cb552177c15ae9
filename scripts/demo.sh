#!/usr/bin/env bash
# The default job on a CPU: a tiny Qwen2.5-VL learns video temporal grounding. Builds the tiny checkpoint and the easy
# synthetic videos if missing, evaluates the untrained model, warms it up with SFT, trains it with GRPO, evaluates
# after each stage, and prints the three evaluations beside trivial baselines with the paths to look at next.
#   bash scripts/demo.sh [--quick | --long] [--seed N] [--workdir DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
exec mmpg demo "$@"
