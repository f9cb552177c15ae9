"""What the fast paths of this process chose, and why: one record per path, for the run header, run.json and the eval
report.

A fast path that has not run where it runs now checks itself on the run's first batch against the exact path and
steps down to the next one in one warning line. Each such decision is recorded here:

    record("grouped_backend", "sdpa", "flash failed the self-check: max |dlogp| 0.31 > bound 0.05 (flash-attn 2.7.4)")
    record("decode_kernel", "flash")
    current()  -> {"grouped_backend": {"value": "sdpa", "why": "..."}, "decode_kernel": {"value": "flash", "why": ""}}

The trainer persists `current()` under run.json's "fast_paths" whenever it changed (`changed_since`), and the
evaluator writes it into its report. Keys are short snake_case names of a path; values are the chosen
implementation. Why it is process-wide, like `logging`: a process runs one job, and the decisions are taken deep
inside the engines (a kernel's first call, a self-check's fallback) that the job reaches through many call paths; each
rank records its own, and ranks decide alike.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_choices: dict[str, dict[str, str]] = {}
_version = 0


def record(key: str, value: str, why: str = "") -> None:
    """Record that path `key` now runs `value` (`why`: the reason for a step-down, empty for a first choice)."""
    global _version
    entry = {"value": str(value), "why": str(why)}
    with _lock:
        if _choices.get(key) != entry:
            _choices[key] = entry
            _version += 1


def current() -> dict[str, dict[str, str]]:
    """A copy of every recorded choice: {key: {"value", "why"}}."""
    with _lock:
        return {k: dict(v) for k, v in _choices.items()}


def version() -> int:
    """A counter that grows with every change of the record (to persist only when something changed)."""
    return _version


def summary() -> str:
    """One line for a log: "grouped_backend=sdpa (flash failed ...), decode_kernel=flash"."""
    return ", ".join(f"{k}={v['value']}" + (f" ({v['why']})" if v["why"] else "") for k, v in current().items())


def reset() -> None:
    """Forget every choice (tests; a process that loads a new model)."""
    global _version
    with _lock:
        _choices.clear()
        _version += 1
