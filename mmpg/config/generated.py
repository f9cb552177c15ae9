"""Inputs that mmpg builds itself: a config that points into such a folder before it is built gets the command that
builds it, not a missing-file error in the middle of setup."""

from __future__ import annotations

from pathlib import Path

DEMO_WORKDIR = "data/generated/demo"  # `mmpg demo --workdir`'s default; configs/*cpu_demo.yaml point into it
# folder -> (what it holds, the command that builds it)
BUILT_BY = {DEMO_WORKDIR: ("the demo's tiny model and easy videos",
                           "`mmpg demo --build-only` (bash scripts/train_cpu_demo.sh does it first)")}


def unbuilt_input(*paths: str) -> str | None:
    """The one-line error for the first missing path inside a folder of `BUILT_BY`, naming the command that builds
    it; None when every path exists or lies elsewhere."""
    for text in filter(None, paths):
        path = Path(text).expanduser().resolve()
        if path.exists():
            continue
        for folder, (what, command) in BUILT_BY.items():
            if Path(folder).resolve() in path.parents:
                return f"{text} does not exist yet: it is part of {what}; build them with {command}"
    return None
