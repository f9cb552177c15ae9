#!/usr/bin/env bash
# Browse a run directory (or an evaluation folder) in a local web page: rollouts, rewards, timelines, curves, evals.
#   bash scripts/inspect.sh runs/my_run                 http://127.0.0.1:7860 (this machine only)
#   bash scripts/inspect.sh runs/my_run --port 8080     from another machine: ssh -L 8080:127.0.0.1:8080 THIS_HOST
#   bash scripts/inspect.sh --example                   a synthetic 1,000-step run (written once, about a minute)
#   bash scripts/inspect.sh runs/sft runs/grpo          compare runs (or a folder holding them): curves and evals overlaid
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
if [ "${1:-}" = "--example" ]; then
  shift
  run=data/generated/inspector_example
  [ -f "$run/metrics.jsonl" ] || python -m mmpg.bench.inspector_run "$run"
  set -- "$run" "$@"
fi
exec mmpg inspect "$@"
