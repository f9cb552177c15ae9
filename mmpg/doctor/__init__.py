"""Checking a machine for mmpg: `mmpg doctor` (cli.py) runs every path on tiny models built here against its exact
reference and writes its results (results.py); `wheelhouse.py` gathers the wheels an air-gapped GPU node installs from.

Nothing here is imported by the library (mmpg/grouping, mmpg/rollout, ...): this package sits above all of them.
"""
