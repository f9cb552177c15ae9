"""The evaluation folder: what `mmpg eval` writes for one checkpoint on one benchmark, and how readers get it back.
Its format, file by file, is in docs/inspector.md ("An evaluation folder"), with the same `LAYOUT_VERSION` as run
directories.

    EVAL_DIR/  eval.json  predictions.jsonl  metrics.json  report.md  plots/*.png
    RUN_DIR/evals/<benchmark>/step_00000040/     a training run's evaluation of its step-40 checkpoint
    RUN_DIR/evals/<benchmark>/over_steps.md|png  metrics over training steps (`run_benchmark_dir`)

What a caller relies on: predictions.jsonl holds one `PredictionRecord` per line, appended as produced, so a rerun
skips the indices already there (`EvalWriter.done`); eval.json keeps the first run's settings and `check_settings`
refuses a rerun with different ones; every other file is written atomically (names starting with "." are in
progress and never listed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

from mmpg.errors import UserError
from mmpg.runs.files import append_line, atomic_write_json, atomic_write_text, check_version, jsonable, \
    read_jsonl, repair_tail, resolve_inside
from mmpg.runs.layout import LAYOUT_VERSION

EVAL_JSON = "eval.json"
PREDICTIONS_JSONL = "predictions.jsonl"
METRICS_JSON = "metrics.json"
REPORT_MD = "report.md"
PLOTS_DIR = "plots"
EVALS_DIR = "evals"  # inside a run directory
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclasses.dataclass(kw_only=True)
class PredictionRecord:
    """One benchmark sample and the model's answer."""

    v: int = LAYOUT_VERSION
    index: int  # position of the sample in the benchmark (after annotation loading), 0-based
    sample_id: str
    video: str  # path of the video file
    duration: float  # seconds (NaN when the video could not be read)
    query: str
    gt_span: list[float]  # [start_s, end_s]
    pred_span: list[float] | None  # parsed answer, None when unparseable or failed
    text: str  # the decoded answer ("" when the sample failed)
    iou: float  # tIoU with the ground truth; 0 when pred_span is None
    error: str | None = None  # why the sample could not be evaluated (missing or corrupt video), else None
    # template=zoom only (else None): the answer's trajectory in order, the model's turns {"model": text} and the
    # tool's {"zoom": [start_s, end_s], "frames": n} (a clip of n frames shown) or {"error": reason}; `text` is the
    # last model turn
    turns: list[dict] | None = None

    def to_json(self) -> dict:
        return jsonable(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> PredictionRecord:
        check_version(d, f"prediction {d.get('index')}")
        keys = [f.name for f in dataclasses.fields(cls)]
        missing = [k for k in keys if k not in d and k not in ("v", "error", "turns")]
        if missing:
            raise ValueError(f"prediction record lacks {', '.join(missing)}: {str(d)[:200]}")
        kwargs = {k: d[k] for k in keys if k in d}
        kwargs["duration"] = math.nan if kwargs["duration"] is None else float(kwargs["duration"])
        return cls(**kwargs)


class EvalWriter:
    """Writes one evaluation folder (rank 0 only; other ranks: no-ops). Safe to reopen: `done()` tells which
    sample indices already have a prediction, so a rerun continues where a killed one stopped."""

    def __init__(self, folder: str | os.PathLike, *, rank: int = 0):
        self.folder, self.rank = Path(folder), rank

    def start(self, info: dict) -> None:
        """Create the folder and write eval.json (kept when present: the first run's settings are the record;
        `check_settings` refuses a rerun with different ones)."""
        if self.rank != 0:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / EVAL_JSON
        if not path.is_file():
            atomic_write_json(path, dict(info, layout_version=LAYOUT_VERSION, kind="eval"))
        if (self.folder / PREDICTIONS_JSONL).is_file():
            repair_tail(self.folder / PREDICTIONS_JSONL)

    def done(self) -> set[int]:
        """Indices with a prediction already written."""
        path = self.folder / PREDICTIONS_JSONL
        return {int(d["index"]) for d in read_jsonl(path)} if path.is_file() else set()

    def append(self, records: list[PredictionRecord]) -> None:
        if self.rank != 0:
            return
        for record in records:
            append_line(self.folder / PREDICTIONS_JSONL, record.to_json())

    def write_metrics(self, metrics: dict) -> None:
        if self.rank == 0:
            atomic_write_json(self.folder / METRICS_JSON, dict(metrics, v=LAYOUT_VERSION))

    def write_text(self, name: str, text: str) -> Path | None:
        """report.md or another text file in the folder, atomically."""
        if self.rank != 0:
            return None
        return atomic_write_text(self.folder / name, text)

    def plot_path(self, name: str) -> Path:
        """Where a plot goes (the folder is created); the caller saves the PNG to a temp name and renames."""
        (self.folder / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
        return self.folder / PLOTS_DIR / name


class EvalReader:
    """Read-only view of an evaluation folder."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if not (self.folder / EVAL_JSON).is_file():
            raise UserError(f"{self.folder} is not an evaluation folder (no {EVAL_JSON}); pass a folder mmpg eval "
                            "wrote")
        version = self.info().get("layout_version", LAYOUT_VERSION)
        if isinstance(version, int) and version > LAYOUT_VERSION:
            raise UserError(f"{self.folder}: written with layout version {version}, this mmpg reads up to "
                            f"{LAYOUT_VERSION}; upgrade mmpg")

    def info(self) -> dict:
        try:
            return json.loads((self.folder / EVAL_JSON).read_text(encoding="utf-8"))
        except ValueError as e:
            raise UserError(f"{self.folder / EVAL_JSON}: not valid JSON ({e})") from None

    def predictions(self) -> list[PredictionRecord]:
        """By index; the first line of an index wins if a sample appears twice."""
        path = self.folder / PREDICTIONS_JSONL
        seen: dict[int, PredictionRecord] = {}
        for d in read_jsonl(path) if path.is_file() else []:
            record = PredictionRecord.from_json(d)
            seen.setdefault(record.index, record)
        return [seen[i] for i in sorted(seen)]

    def metrics(self) -> dict | None:
        """metrics.json, or None while the evaluation has not finished."""
        path = self.folder / METRICS_JSON
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None

    def plots(self) -> list[Path]:
        folder = self.folder / PLOTS_DIR
        return sorted(p for p in folder.glob("*.png") if not p.name.startswith(".")) if folder.is_dir() else []

    def resolve(self, relpath: str | os.PathLike) -> Path:
        """The real path of `relpath` inside the folder; UserError for anything that would leave it."""
        return resolve_inside(self.folder, relpath, "the evaluation folder")


def run_eval_dir(run_dir: str | os.PathLike, benchmark: str, step: int) -> Path:
    """RUN_DIR/evals/<benchmark>/step_XXXXXXXX."""
    return run_benchmark_dir(run_dir, benchmark) / f"step_{step:08d}"


def run_benchmark_dir(run_dir: str | os.PathLike, benchmark: str) -> Path:
    """RUN_DIR/evals/<benchmark> (the name made filesystem-safe), where over_steps.md|png go."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", benchmark).strip("._") or "benchmark"
    return Path(run_dir) / EVALS_DIR / safe


def check_settings(folder: str | os.PathLike, info: dict,
                   keys: tuple[str, ...] = ("checkpoint", "annotations", "videos", "protocol", "settings"),
                   defaults: dict[str, dict] | None = None) -> None:
    """Refuse to continue an evaluation folder whose eval.json records other `keys` than `info` (one level deep
    for dict values, so the message names e.g. settings.fps); nothing to check when the folder has no eval.json.
    `defaults[key]` gives what an entry absent from the stored dict `key` reads as (a setting added after that
    folder was written, whose default makes the numbers it made then)."""
    path = Path(folder) / EVAL_JSON
    if not path.is_file():
        return
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e}); delete the folder to start the evaluation over") from None
    now = jsonable(info)
    diffs = []
    for key in keys:
        old, new = stored.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            absent = (defaults or {}).get(key, {})
            diffs += [(f"{key}.{k}", old.get(k, absent.get(k)), new.get(k)) for k in sorted(set(old) | set(new))
                      if old.get(k, absent.get(k)) != new.get(k)]
        elif old != new:
            diffs.append((key, old, new))
    if diffs:
        shown = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, a, b in diffs[:3])
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise UserError(f"{folder} holds an evaluation made with other settings ({shown}{more}); pass another "
                        "--out, or delete the folder to start over")


def list_run_evals(run_dir: str | os.PathLike) -> list[tuple[str, int, Path]]:
    """(benchmark, step, folder) of every evaluation folder inside a run directory, sorted."""
    root = Path(run_dir) / EVALS_DIR
    out = []
    for bench in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        for folder in bench.iterdir():
            m = _STEP_DIR.match(folder.name)
            if m and (folder / EVAL_JSON).is_file():
                out.append((bench.name, int(m.group(1)), folder))
    return sorted(out, key=lambda t: (t[0], t[1]))
