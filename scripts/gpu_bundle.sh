#!/usr/bin/env bash
# What travels to the lent GPU machine beside the working tree: the wheels its image lacks for mmpg's GPU checks
# (mmpg/grouping/gpu_bundle.py BUNDLE: cp312 manylinux x86-64, their missing dependencies, nothing the image has)
# into wheels/, and the synthetic training videos into wheels/synth/ (rendering needs av, which does not travel).
# Run here, where pip reaches a registry; downloads only what wheels/ lacks, so a second run is offline and quick.
# Prints the wheel list and the total size, and fails (exit 1) when wheels/ plus the working tree would pass the
# device tool's 64 MiB; exit 2 when a wheel cannot be fetched (no registry?).
#   bash scripts/gpu_bundle.sh            then: bash scripts/gpu_check.sh --rehearse (proves the bundle complete)
# On the GPU machine:  bash scripts/gpu_check.sh   (wheels/ copied beside the tree)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/env.sh dev >/dev/null
py=.venv/bin/python
wheels="${MMPG_GPU_WHEELS:-$root/wheels}"
mkdir -p "$wheels"
mapfile -t flags < <("$py" -m mmpg.grouping.gpu_check bundle-flags)
for spec in $("$py" -m mmpg.grouping.gpu_check bundle-specs); do
  req="${spec#sdist:}"; name="${req%%==*}"; version="${req#*==}"
  if compgen -G "$wheels/${name//-/_}-$version-*.whl" >/dev/null; then continue; fi
  if [ "$spec" != "$req" ]; then
    # an sdist only (deepspeed): built here without its ops (DS_BUILD_OPS=0: JIT-built on first use), so the wheel
    # is pure Python and fits the image's Python 3.12
    echo "[gpu_bundle] building $req (sdist only on the registry)"
    DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps -w "$wheels" "$req" \
      || { echo "[gpu_bundle] could not build $req" >&2; exit 2; }
    built=$(compgen -G "$wheels/${name//-/_}-$version-*.whl" | head -1)
    if [[ "$built" != *-py3-none-any.whl ]]; then
      echo "[gpu_bundle] $built is not pure Python: it would not fit Python 3.12" >&2; rm -f "$built"; exit 2
    fi
  else
    echo "[gpu_bundle] downloading $req"
    "$py" -m pip download -q --no-deps "${flags[@]}" -d "$wheels" "$req" \
      || { echo "[gpu_bundle] could not download $req for cp312 manylinux x86-64 (registry unreachable?)" >&2; exit 2; }
  fi
done
if [ ! -f "$wheels/synth/train.json" ]; then
  echo "[gpu_bundle] rendering the synthetic training videos into $wheels/synth"
  rm -rf "$wheels/synth"
  "$py" -m mmpg.cli synth --out "$wheels/synth" --n 16 --min-duration 8 --max-duration 16 >/dev/null
fi
exec "$py" -m mmpg.grouping.gpu_check bundle-list --wheels "$wheels"
