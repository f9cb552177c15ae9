#!/usr/bin/env bash
# Benchmark the grouped forward against the repeated baseline and the upstream prefix_grouper package; prints a
# table and writes JSON (runs/bench/<timestamp>.json unless --out). A program, never a test.
#   bash scripts/bench.sh                          the two judged CPU rows (--preset cpu-targets, ~10 min on 2 cores)
#   bash scripts/bench.sh --preset cpu-grid --dry-run   the grid's ceilings and memory estimates, nothing run
#   bash scripts/bench.sh --preset gpu --out runs/bench/gpu.json
#   bash scripts/bench.sh --levels rollout         prefill once vs num_return_sequences
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
# without --preset this script runs the default one (`mmpg bench` alone only prints what it would run)
case " $* " in *" --preset "*|*" --preset="*) ;; *) set -- --preset cpu-targets "$@" ;; esac
exec python -m mmpg.bench.cli "$@"
