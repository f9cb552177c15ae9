#!/usr/bin/env bash
# Run the test suite on a CPU: every test that can run here, `slow` ones included; `gpu` tests skip without CUDA.
#   bash scripts/test.sh           full suite (installs .venv on first use)
#   bash scripts/test.sh --quick   skip `slow` tests, for iteration
#   extra arguments go to pytest, e.g. bash scripts/test.sh -k grouping
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
args=()
if [ "${1:-}" = "--quick" ]; then shift; args+=(-m "not slow"); fi
exec python -m pytest -p no:cacheprovider "${args[@]}" "$@"
