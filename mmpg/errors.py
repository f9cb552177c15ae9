"""Errors a user can fix. The CLI prints them as one line and exits with status 2.

`mmpg.grouping` imports no other mmpg package, so the errors it raises for a user's situation are its own
`RuntimeError` subclasses (an installed transformers outside the tested range or without a feature the grouped
forward calls; an input the model no longer consumes); `is_user_error` counts them here, by type.
"""

from __future__ import annotations

import sys

# (module, class) of the errors raised outside this module that a user fixes (by installing another transformers)
_ELSEWHERE = (("mmpg.grouping.patch", "UnsupportedTransformersError"), ("mmpg.grouping.attention", "IgnoredInputError"))


class UserError(ValueError):
    """Bad input from the user (a flag, a file, a folder). The message says what and what to do."""


def is_user_error(err: BaseException) -> bool:
    """Whether the CLI shows `err` as one line with exit status 2: a `UserError`, or one of `_ELSEWHERE` (looked up
    only where its module is loaded: otherwise nothing raised it, and the CLI need not import torch to know)."""
    kinds = [UserError] + [getattr(sys.modules[m], name) for m, name in _ELSEWHERE if m in sys.modules]
    return isinstance(err, tuple(kinds))
