#!/usr/bin/env bash
# The transformers version matrix: the grouped forward's equivalence, positions and contract tests, the self-check, the
# rollout engine's and the evaluation's tests, Qwen3-VL's prompt form, run again against the oldest transformers mmpg
# supports (mmpg.grouping.patch.TRANSFORMERS_RANGE) and the newest on the package registry. Each version lives in a side
# folder .venv-tf/VERSION put on PYTHONPATH ahead of .venv: transformers itself and those of its requirements .venv does
# not satisfy (huggingface_hub for 5.17), everything else is .venv's; a version whose requirements the registry lacks is
# skipped, saying which. Stamped when it imports; a half-made one is removed; a version equal to .venv's own is covered
# by the main run; without a registry the versions it cannot fetch are skipped, saying why.
#   bash scripts/tf_matrix.sh            (scripts/test.sh runs it after the main suite; ~1.5 min when the folders exist)
#   bash scripts/tf_matrix.sh --prepare  only make the folders (scripts/test.sh does, beside its other installs)
set -uo pipefail
prepare=0; [ "${1:-}" = --prepare ] && prepare=1
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
cd "$MMPG_ROOT"
tests=(tests/test_grouping_equivalence.py tests/test_grouping_positions.py tests/test_grouping_contract.py
       tests/test_grouping_layout.py tests/test_grouping_shares.py tests/test_selfcheck.py
       tests/test_flash_loaded_models.py tests/test_rollout.py
       tests/test_rollout_seeds.py tests/test_cascade.py tests/test_rollout_shares.py tests/test_eval_run.py
       tests/test_lora.py tests/test_sequence_parallel.py tests/test_prefill_chunks.py tests/test_share_any_order.py
       tests/test_qwen3_prompt_form.py tests/test_trajectory_tree.py tests/test_zoom_tool.py tests/test_zoom_rollout.py)
# on test.sh's workers (MMPG_TEST_WORKERS, default 2; 0: one process), one thread each
workers=${MMPG_TEST_WORKERS:-2}
pytest=(python -m pytest -p no:cacheprovider -q)
if [ "$workers" != 0 ]; then
  pytest=(env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${pytest[@]}" -n "$workers" --dist loadfile)
fi
installed="$(python -c 'import transformers; print(transformers.__version__)')"
oldest="$(python -c 'from mmpg.grouping.patch import TRANSFORMERS_RANGE as r; print(r[0])')"
newest="$(python -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')"
[ -n "$newest" ] || echo "[mmpg] tf matrix: the registry gave no newest transformers (offline?): only $oldest"
status=0
for v in $oldest $newest; do
  if [ "$v" = "$installed" ]; then
    echo "[mmpg] tf matrix: transformers $v is .venv's own: the main run covered it"; continue
  fi
  dir=".venv-tf/$v"
  if [ ! -f "$dir/.mmpg-ok" ]; then
    rm -rf "$dir"
    if ! python -m pip install -q --target "$dir" --no-deps "transformers==$v" >/dev/null 2>&1; then
      rm -rf "$dir"; echo "[mmpg] tf matrix: could not fetch transformers $v (registry unreachable?): skipped"; continue
    fi
    # the requirements of this transformers that .venv does not satisfy (5.17 wants huggingface_hub < 2.0, 5.25
    # wants kernels >= 0.19.1), each into the side folder; a version whose requirements the registry does not offer
    # is one a user cannot install from it either: skipped, saying which
    unmet="$(python - "$dir" <<'PY'
import sys, glob
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
meta = glob.glob(f"{sys.argv[1]}/transformers-*.dist-info/METADATA")[0]
for line in open(meta, encoding="utf-8"):
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker:
            continue
        try:
            ok = req.specifier.contains(version(req.name), prereleases=True)
        except PackageNotFoundError:
            ok = False
        if not ok:
            print(f"{req.name}{req.specifier}")
PY
)"
    missing=""
    for req in $unmet; do
      python -m pip install -q --target "$dir" --no-deps "$req" >/dev/null 2>&1 || missing="$missing $req"
    done
    if [ -n "$missing" ]; then
      rm -rf "$dir"; echo "[mmpg] tf matrix: transformers $v needs$missing, which the registry does not offer: skipped"
      continue
    fi
    if ! PYTHONPATH="$dir" python -c "import transformers, sys; sys.exit(transformers.__version__ != '$v')"; then
      rm -rf "$dir"; echo "[mmpg] tf matrix: transformers $v does not import beside .venv: skipped" >&2; status=1
      continue
    fi
    echo "$unmet" > "$dir/.mmpg-ok"  # the stamp holds what the folder adds besides transformers
  fi
  unmet="$(cat "$dir/.mmpg-ok")"
  if [ "$prepare" = 1 ]; then echo "[mmpg] tf matrix: transformers $v ready"; continue; fi
  echo "[mmpg] tf matrix: transformers $v${unmet:+ with $unmet}"
  t0=$SECONDS
  PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "${pytest[@]}" "${tests[@]}" || status=1
  echo "[mmpg] tf matrix: transformers $v took $((SECONDS - t0)) s"
done
exit $status
