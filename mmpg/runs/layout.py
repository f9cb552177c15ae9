"""The run directory: the only interface between training (and the evaluator) and its readers (app, eval, plots).

Layout version 1. Every file below carries `LAYOUT_VERSION` ("layout_version" in run.json, "v" in each JSON line
and record); a reader refuses a version newer than its own and says to upgrade mmpg.

    RUN_DIR/
      run.json                      {"layout_version": 1, "created": iso time, "mmpg_version": "0.1.0",
                                     "command": [argv...], "kind": "grpo" | "sft" | "eval",
                                     "parameters": {"trainable": n, "total": n, "text": "trainable parameters: ...",
                                                    "lora": {"r", "alpha", "dropout", "modules"} | null},
                                     "device": "cuda" | "cpu", "devices": world size (training runs),
                                     "peak_memory": what perf/peak_memory_mb is (training runs,
                                               mmpg.train.peak_memory): {"measure": "cuda.max_memory_allocated" |
                                               "cpu.rss_above_baseline" | "cpu.ru_maxrss", "from_step": first step
                                               it holds for; CPU: "baseline_mb", "high_water", "mmap_threshold"},
                                     "model": {"path": model.path as given, "folder": what was loaded,
                                               "repo_id": hub id | null, "revision": commit | null}}
                                                                            written once, atomically
      config.yaml                   the resolved config, as YAML text (rewritten atomically at every start)
      metrics.jsonl                 one line per training step:
                                      {"v": 1, "step": int, "time": unix seconds,
                                       "reward/mean": ..., "timing_s/rollout": ..., <namespaced metrics>}
      eval.jsonl                    one line per evaluation during training:
                                      {"v": 1, "step": int, "time": unix seconds, <metrics>}
      rollouts/step_00000012.jsonl  one `GroupRecord` per line (mmpg.runs.records), written atomically per step
      media/<media_key>/frame_00.jpg, frame_01.jpg, ...   thumbnails of one video, written once per video
      media/<media_key>/meta.json   {"v": 1, "video": path, "times": [seconds of each thumbnail],
                                     "frames": [file names, in the order of times]}
      tb/                           TensorBoard event files (same scalars as metrics.jsonl; eval under "eval/")
      checkpoints/step_00000012/    a complete checkpoint: a folder holding the file COMPLETE, written last
      checkpoints/.tmp-step_...     a checkpoint being written (readers ignore it; pruning removes stale ones)
      train.log                     the trainer's log (written by the trainer, not by mmpg.runs)
      evals/<benchmark>/step_XXXXXXXX/  evaluation folders of this run's checkpoints (layout in mmpg/runs/evals.py)

A rollout line (`GroupRecord.to_json()`; units and meanings of each field in mmpg/runs/records.py):

    {"v": 1, "step": 12, "group_index": 0, "sample_id": "...", "video": path, "duration": seconds, "query": "...",
     "gt_span": [start_s, end_s], "media_key": key | null,
     "responses": [{"text": "...", "parsed_span": [start_s, end_s] | null, "rewards": {"overall": ..., ...},
                    "advantage": float, "length": tokens, "finish_reason": "stop" | "length"}, ... G of them]}

COMPLETE holds {"v": 1, "completed": iso time}; its presence, not its content, marks a checkpoint complete.

Guarantees a reader can rely on, even after `kill -9`:
- JSON lines are appended whole (one write of line + "\\n", then fsync). Only the LAST line of a file can be cut
  short; readers skip it (`read_jsonl`), and the next writer cuts it off before appending. A damaged line anywhere
  else is an error naming file:line.
- Non-finite floats (NaN, inf) are written as null, so every line is valid JSON.
- rollouts/step_*.jsonl, media/<key>/, run.json, config.yaml appear complete or not at all (temp name + rename).
  Temp names start with "." and never match the patterns readers list.
- A resumed run (`RunWriter.start(resume_step=k)`) first drops metric/eval lines and rollout files of steps > k, so
  no step is ever recorded twice by one run. A reader still keeps the last line of a step if it finds duplicates.
- `media_key` is the video's file stem (made filesystem-safe) plus 12 hex digits of the SHA-1 of its path string.
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
