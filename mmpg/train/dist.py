"""Moved to `mmpg.dist` (training and evaluation share it); this name stays until the bench imports the new one."""

from mmpg.dist import *  # noqa: F401,F403
from mmpg.dist import _reduce  # noqa: F401
