"""`python -m mmpg ...`: the `mmpg` command, where its console script is not on PATH (an interpreter named by path,
a job script that activates nothing)."""

import sys

from mmpg.cli import main

sys.exit(main())
