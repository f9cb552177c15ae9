"""The run directory: the only interface between training (and the evaluator) and its readers (app, eval, plots).
Its format, file by file, is in docs/inspector.md ("The files it reads"); this module holds its names.

What a caller relies on:
- `LAYOUT_VERSION` is in every file ("layout_version" in run.json, "v" in each JSON line and record); a reader
  refuses a newer version than its own and says to upgrade mmpg.
- JSON lines are appended whole; only a file's last line can be cut short (readers skip it), and non-finite floats
  are written as null. Rollout files, media folders, run.json and config.yaml appear complete or not at all.
- Names starting with "." (`TEMP_PREFIX` folders included) are in progress: readers never list them.
- Steps are named `step_name(step)` ('step_00000012'), which sorts in step order up to 10^8 steps.
- `media_key(video)` names a video's media folder: its stem, made filesystem-safe, plus 12 hex digits of the SHA-1 of
  the path string as given; readers take it from the record and never recompute it.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
from pathlib import Path

LAYOUT_VERSION = 1

RUN_JSON = "run.json"
CONFIG_YAML = "config.yaml"
METRICS_JSONL = "metrics.jsonl"
EVAL_JSONL = "eval.jsonl"
ROLLOUTS_DIR = "rollouts"
MEDIA_DIR = "media"
MEDIA_META = "meta.json"
TB_DIR = "tb"
CHECKPOINTS_DIR = "checkpoints"
COMPLETE = "COMPLETE"
TRAIN_LOG = "train.log"

KINDS = ("grpo", "sft", "eval")  # run.json "kind"; "eval" for folders the evaluator writes with RunWriter

TEMP_PREFIX = ".tmp-"  # in-progress checkpoints and media folders; readers never list names starting with "."
_STEP_NAME = "step_%08d"
_ROLLOUT_RE = re.compile(r"^step_(\d+)\.jsonl$")
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def step_name(step: int) -> str:
    """'step_00000012' for step 12 (names sort in step order up to 10^8 steps)."""
    try:
        ok = not isinstance(step, bool) and operator.index(step) >= 0  # ints, numpy ints
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"a step must be an int >= 0, got {step!r}")
    return _STEP_NAME % operator.index(step)


def rollout_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"{step_name(step)}.jsonl"


def rollout_step(name: str) -> int | None:
    """The step of a rollout file name ('step_00000012.jsonl' -> 12), None for any other name."""
    m = _ROLLOUT_RE.match(name)
    return int(m.group(1)) if m else None


def step_dir_step(name: str) -> int | None:
    """The step of a checkpoint folder name ('step_00000012' -> 12), None for any other name (temp ones included)."""
    m = _STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def media_key(video_path: str | os.PathLike) -> str:
    """A filesystem-safe, stable name for a video's media folder: readable stem + hash of the path string.

    The path is hashed as given (no resolving), so the writer's key is the one stored in `GroupRecord.media_key`;
    readers never recompute it.
    """
    path = os.fspath(video_path)
    digest = hashlib.sha1(path.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    stem = _UNSAFE.sub("_", Path(path).stem).strip("._")[:40]
    return f"{stem}-{digest}" if stem else digest


def is_safe_key(key: str) -> bool:
    """True for a name usable as one path component that readers would list (no separators, no leading dot)."""
    return bool(key) and not key.startswith(".") and _UNSAFE.search(key) is None
