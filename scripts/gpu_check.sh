#!/usr/bin/env bash
# The one prepared GPU run (issue 24): every GPU path of mmpg on one GPU machine in 8 minutes of wall clock, and its
# rehearsal on this machine's CPU.
#   here, first:  bash scripts/gpu_bundle.sh && bash scripts/gpu_check.sh --rehearse
#   the GPU machine:  bash scripts/gpu_check.sh   (wheels/ copied beside the tree)
# Stages, in order, each under its own limit (`python -m mmpg.grouping.gpu_check plan`; a stage that reaches it is
# killed and what it did not finish is reported NOT RUN), every line stamped with the seconds elapsed:
#   install  wheels/*.whl with pip --no-index --no-deps --target <work>/site, put on PYTHONPATH (the image's torch
#            stays). Rehearsal: pip resolves that install offline for cp312 manylinux against wheels/ with the
#            image's packages counted present (mmpg/grouping/gpu_bundle.py), and the size against 64 MiB
#   env      torch, CUDA, driver, GPU, transformers, which backends are usable and why not; the bundle's
#            requirements against the versions installed
#   collect  pytest --collect-only of the test files: every path gets its row, cut-off tests are named
#   tests    the `gpu` tests, one process per file: grouped forward (tests-grouped: sdpa masked, varlen LSE merge,
#            flex, flash; fp32 and bf16) and cascade decoding (tests-cascade), tiny and released head geometry.
#            Rehearsal: the same files (skipped without CUDA) and their CPU counterparts (tests-cpu)
#   train    scripts/gpu_train_check.sh: mmpg train in bf16, ZeRO-0 and ZeRO-3, grouped and repeated, logprob gap
#   bench    mmpg bench's GPU presets, sized by the FLOPs model to the seconds left (gpu_check plan-bench).
#            Rehearsal: --preset tiny on the CPU; then the import audit (scripts/gpu_check_audit)
#   summary  every path PASS / FAIL / NOT RUN with its figure: gpu_check.md and gpu_check.json
# Results in $OUT (else runs/gpu_check/<mode>-<time>/): gpu_check.log, gpu_check.md, gpu_check.json, bench-*.json.
# Exit: 0 when every path ran and passed, 1 otherwise, 3 without a usable GPU. Rehearsal: 0 when the bundle is
# complete and every stage that needs no GPU passed (the GPU rows are NOT RUN, with the reason).
# MMPG_GPU_VLLM=1 adds a stage for the vLLM engine's GPU tests after the bench, outside the 8 minutes (a registry).
# flash-attn: a flash_attn-*.whl in wheels/ built for the image's torch 2.11.0+cu130 / Python 3.12 is installed with
# the rest; none is downloaded (PyPI has an sdist, whose build takes longer than a lease), so its paths stay NOT RUN.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mode=device
[ "${1:-}" = --rehearse ] && mode=rehearse
start=$(date +%s)
out="${OUT:-$root/runs/gpu_check/$mode-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
work="$(mktemp -d -t mmpg-gpu-check.XXXXXX)"  # stage records, checkpoints, train runs: never sent back
log="$out/gpu_check.log"
wheels="${MMPG_GPU_WHEELS:-$root/wheels}"
say() { printf '[gpu_check %3ds] %s\n' "$(( $(date +%s) - start ))" "$*" | tee -a "$log"; }
export FORCE_QWENVL_VIDEO_READER=decord TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "$mode" = device ]; then
  py="${MMPG_GPU_CHECK_PYTHON:-python3}" site="$work/site" device=cuda
  export PYTHONPATH="$root:$root/tests:$site${PYTHONPATH:+:$PYTHONPATH}"
else
  source scripts/env.sh dev >/dev/null || { echo "gpu_check: scripts/env.sh dev failed" >&2; exit 1; }
  set +e  # env.sh turns on -e; a failing stage must not end the run
  py="$root/.venv/bin/python" site="" device=cpu
  # the import audit: every Python process of the rehearsal records what mmpg and the tests import
  export PYTHONPATH="$root/scripts/gpu_check_audit:$root:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
  export MMPG_IMPORT_AUDIT="$work/imports.tsv" MMPG_IMPORT_AUDIT_ROOT="$root"
fi
eval "$("$py" -m mmpg.grouping.gpu_check plan --mode "$mode")" || { say "no plan"; exit 1; }
deadline=$(( start + TOTAL_S - 10 ))  # 10 s for kill grace and the last copies
say "mode $mode, results in $out, work folder $work"
say "plan (seconds): install $INSTALL_S, env $ENV_S, collect $COLLECT_S, tests-grouped $TESTS_GROUPED_S," \
  "tests-cascade $TESTS_CASCADE_S,${TESTS_CPU_S:+ tests-cpu $TESTS_CPU_S,} train $TRAIN_S, bench $BENCH_S" \
  "(device: what is left when it starts), summary $SUMMARY_S; total $TOTAL_S"
if [ "$mode" = rehearse ]; then
  say "the device run's plan, for comparison:"
  "$py" -m mmpg.grouping.gpu_check plan --mode device | tr '\n' ' ' | tee -a "$log"; echo | tee -a "$log"
  eval "$("$py" -m mmpg.grouping.gpu_check plan --mode device | grep BENCH_S)"
  "$py" -m mmpg.grouping.gpu_check plan-bench --left "$BENCH_S" --mode device | while read -r n e w a; do
    say "  device bench run $n: ~$e s by the FLOPs model, $w s per worker: mmpg bench $a"; done
  eval "$("$py" -m mmpg.grouping.gpu_check plan --mode rehearse)"
fi

# run_stage NAME LIMIT COMMAND...: COMMAND under `timeout` (never past the deadline), output to the log, one record in
# stages.jsonl; returns COMMAND's status (124/137: stopped at the limit)
run_stage() {
  local name="$1" limit="$2"; shift 2
  local left=$(( deadline - $(date +%s) - SUMMARY_S ))
  [ "$name" = summary ] && left=$(( deadline - $(date +%s) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    say "stage $name: NOT RUN, no time left"
    printf '{"stage": "%s", "rc": 124, "elapsed_s": 0, "limit_s": 0}\n' "$name" >>"$work/stages.jsonl"
    return 124
  fi
  say "stage $name (limit $limit s)"
  local t0 rc
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" </dev/null 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  printf '{"stage": "%s", "rc": %d, "elapsed_s": %d, "limit_s": %d}\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" \
    "$limit" >>"$work/stages.jsonl"
  say "stage $name: exit $rc after $(( $(date +%s) - t0 )) s"
  return "$rc"
}

# 1. install
if [ "$mode" = device ]; then
  if compgen -G "$wheels/*.whl" >/dev/null; then
    run_stage install "$INSTALL_S" "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --disable-pip-version-check --target "$site" "$wheels"/*.whl
  elif "$py" -c "import omegaconf, deepspeed, qwen_vl_utils, decord" 2>/dev/null; then
    say "no wheels in $wheels; nothing to install: the bundle's packages import here already (the Docker image?)"
    printf '{"stage": "install", "rc": 0, "elapsed_s": 0, "limit_s": 0, "note": "nothing to install"}\n' \
      >>"$work/stages.jsonl"
    site=""
  else
    say "no wheels in $wheels: run scripts/gpu_bundle.sh where pip works, and name wheels in carry"
    printf '{"stage": "install", "rc": 2, "elapsed_s": 0, "limit_s": 0}\n' >>"$work/stages.jsonl"
    site=""
  fi
else
  run_stage install "$INSTALL_S" "$py" -m mmpg.grouping.gpu_check bundle-check --wheels "$wheels"
fi

# 2. the machine
run_stage env "$ENV_S" "$py" -m mmpg.grouping.gpu_check env --json "$work/env.json" ${site:+--site "$site"}
gpu=$?
# the tests are collected first (no GPU needed), so every path gets its row and a test that a limit cuts off is
# reported NOT RUN by name
files=(tests/test_grouping_gpu.py tests/test_cascade_gpu.py) marker=gpu
[ "$mode" = rehearse ] && files+=(tests/test_release_geometry.py tests/test_gpu_paths_on_cpu.py) marker="not slow"
run_stage collect "$COLLECT_S" bash -c 'set -o pipefail; "$0" -m pytest --collect-only -q -p no:cacheprovider \
  -m "$1" "${@:3}" | grep "::" >"$2"; rc=$?; echo "$(wc -l <"$2") tests collected"; exit $rc' \
  "$py" "$marker" "$work/collected.txt" "${files[@]}"
if [ "$mode" = device ] && [ "$gpu" != 0 ]; then
  say "no usable GPU (above: why): the GPU stages are NOT RUN"
  for s in tests-grouped tests-cascade train bench; do
    printf '{"stage": "%s", "rc": 3, "elapsed_s": 0, "limit_s": 0}\n' "$s" >>"$work/stages.jsonl"
  done
else
  # 3. equivalence tests, one process (and limit) per file, so a slow file cannot starve the other
  tests() {  # stage limit files...
    local name="$1" limit="$2"; shift 2
    MMPG_GPU_CHECK_RESULTS="$work/tests.jsonl" run_stage "$name" "$limit" "$py" -m pytest -q -rs \
      -p no:cacheprovider -p gpu_check_plugin -m "$marker" "$@"
  }
  tests tests-grouped "$TESTS_GROUPED_S" tests/test_grouping_gpu.py
  tests tests-cascade "$TESTS_CASCADE_S" tests/test_cascade_gpu.py
  [ "$mode" = rehearse ] && tests tests-cpu "$TESTS_CPU_S" tests/test_release_geometry.py tests/test_gpu_paths_on_cpu.py

  # 4. training
  steps=3; [ "$mode" = rehearse ] && steps=2
  PYTHON="$py" DEVICE="$device" TRAIN_STEPS="$steps" MMPG_TRAIN_OUT="$work/train" MMPG_SYNTH="$wheels/synth" \
    run_stage train "$TRAIN_S" bash scripts/gpu_train_check.sh

  # 5. the bench, sized to the seconds left
  left=$(( deadline - $(date +%s) - SUMMARY_S ))
  [ "$mode" = rehearse ] && left=$BENCH_S
  planned="$("$py" -m mmpg.grouping.gpu_check plan-bench --left "$left" --mode "$mode")"
  [ -n "$planned" ] || printf '{"name": "bench", "skipped": "no bench run fits the %d s left"}\n' "$left" \
    >>"$work/bench.jsonl"
  while read -r name estimate worker args; do
    [ -n "$name" ] || continue
    left=$(( deadline - $(date +%s) - SUMMARY_S ))
    [ "$mode" = rehearse ] && left=$BENCH_S
    if [ "$left" -lt "$estimate" ]; then
      say "$name: NOT RUN, needs ~$estimate s, $left s left"
      printf '{"name": "%s", "args": "%s", "skipped": "needs ~%d s by the FLOPs model, %d s were left"}\n' \
        "$name" "$args" "$estimate" "$left" >>"$work/bench.jsonl"
      continue
    fi
    limit=$(( estimate * 3 / 2 ))
    say "$name: ~$estimate s by the FLOPs model, $worker s per worker: mmpg bench $args"
    # shellcheck disable=SC2086
    run_stage "$name" "$limit" "$py" -m mmpg.cli bench $args --timeout "$worker" --out "$out/$name.json"
    rc=$?
    printf '{"name": "%s", "rc": %d, "limit_s": %d, "json": "%s.json", "args": "%s"}\n' "$name" "$rc" "$limit" \
      "$name" "$args" >>"$work/bench.jsonl"
  done <<<"$planned"
fi
# opt-in, outside the 8 minutes: the vLLM rollout engine on the GPU (tests/test_vllm_gpu.py). It needs .venv-vllm,
# which scripts/env.sh vllm makes from a registry in minutes: not on the lent machine (no registry; vLLM's CUDA wheel
# is far over the 64 MiB that travel), only on a GPU machine of your own
if [ "$mode" = device ] && [ "${MMPG_GPU_VLLM:-0}" = 1 ] && [ "$gpu" = 0 ]; then
  deadline=$(( $(date +%s) + 900 + SUMMARY_S + 10 ))
  MMPG_GPU_CHECK_RESULTS="$work/tests.jsonl" run_stage tests-vllm 900 bash -c 'source scripts/env.sh vllm && set +e
    "$0" -m pytest --collect-only -q -p no:cacheprovider -m "gpu and vllm" tests/test_vllm_gpu.py | grep "::" >>"$1"
    "$0" -m pytest -q -rs -p no:cacheprovider -p gpu_check_plugin -m "gpu and vllm" tests/test_vllm_gpu.py' \
    "$py" "$work/collected.txt"
fi
if [ "$mode" = rehearse ]; then
  run_stage audit 60 bash -c '"$0" -m mmpg.grouping.gpu_check audit --log "$1" >"$2"; rc=$?; cat "$2"; exit $rc' \
    "$py" "$work/imports.tsv" "$work/audit.txt"
fi

# 6. one table
run_stage summary "$SUMMARY_S" "$py" -m mmpg.grouping.gpu_check report --work "$work" --out "$out" --mode "$mode"
rc=$?
say "done in $(( $(date +%s) - start )) s (limit $TOTAL_S): $out/gpu_check.md"
[ "$mode" = rehearse ] && [ -z "${MMPG_GPU_CHECK_KEEP:-}" ] && rm -rf "$work"
exit "$rc"
