#!/usr/bin/env bash
# The default job on a CPU: build the tiny Qwen2.5-VL checkpoint and synthetic grounding videos if missing, load
# them as a user would, answer one grounding question, and check the grouped forward against the naive one.
#   bash scripts/demo.sh [--family qwen3_vl] [--workdir DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
exec mmpg demo "$@"
