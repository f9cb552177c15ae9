#!/usr/bin/env bash
# A wheelhouse for an air-gapped GPU node: every wheel mmpg needs there, for the node's Python and platform, fetched
# here (where pip reaches a registry), then proven installable offline (mmpg/doctor/wheelhouse.py says how).
#   bash scripts/wheelhouse.sh --python 3.12 --platform manylinux_2_28_x86_64 --out wheelhouse [--have node-freeze.txt]
#     --have      `pip freeze` of the node: what it has already (torch, its CUDA libraries) is neither fetched nor
#                 replaced, and the check holds the requirements against those versions
#     --with-torch  also fetch torch and torchvision (otherwise the node installs its CUDA build from its own index)
# Then copy the folder to the node and run there:
#   pip install --no-index --find-links wheelhouse mmpg && mmpg doctor
# Exit 0 when the node can install mmpg from the folder, 1 naming what is missing, 2 on bad arguments.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/env.sh dev >/dev/null
exec "$root/.venv/bin/python" -m mmpg.doctor.wheelhouse build "$@"
