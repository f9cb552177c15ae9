"""Several runs side by side (SFT vs GRPO, K = 1 vs K = 3, sync vs async), without Gradio: which folders are runs,
one table of their headline figures, and each headline metric as one long table with a series per run.

    runs = find_runs(["runs/sft", "runs/grpo"])       # or find_runs(["runs"]): every run directory inside
    headers, rows = compare_rows(runs)                  # {name: RunSource}
    frame = overlay(runs, "reward/mean", smoothing=0.9)

Figures are the summary's (app/summary.py): the mean of the last 20 logged steps, and the latest held-out
evaluation (eval.jsonl, else the run's evaluation folders).
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from mmpg_app.curves import long_frame
from mmpg_app.run_source import RunSource
from mmpg_app.summary import EVAL_KEYS, run_eval_points, trend
from mmpg.errors import UserError
from mmpg.runs import METRICS_JSONL, RUN_JSON

# (metric, title, unit): one overlay panel each; "eval/..." keys read the held-out evaluations
COMPARE_PANELS = [
    ("reward/mean", "Reward", "reward per response"),
    ("reward/iou", "tIoU of the samples", "tIoU (0-1)"),
    ("sft/loss", "SFT loss", "loss per token"),
    ("data/zero_adv_groups", "Zero-advantage groups", "share of groups"),
    ("eval/miou", "Held-out mIoU", "mIoU (0-1)"),
    ("eval/r1@0.5", "Held-out R1@0.5", "share (0-1)"),
    ("eval/r1@0.7", "Held-out R1@0.7", "share (0-1)"),
]


def is_run_dir(path: Path) -> bool:
    return (path / RUN_JSON).is_file() or (path / METRICS_JSONL).is_file()


def find_runs(paths: list[str | os.PathLike]) -> dict[str, RunSource]:
    """{short name: RunSource} of the run directories named, or found one level inside a folder named, in order.
    UserError naming the folder when one holds no run."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw).resolve()
        if not p.is_dir():
            raise UserError(f"{raw}: no such folder; pass run directories, or a folder holding them")
        inside = [p] if is_run_dir(p) else sorted(c for c in p.iterdir() if c.is_dir() and is_run_dir(c))
        if not inside:
            raise UserError(f"{raw}: neither a run directory nor a folder holding any (a run directory has "
                            f"{RUN_JSON} or {METRICS_JSONL})")
        found += [q for q in inside if q not in found]
    names = [q.name for q in found]
    return {(q.name if names.count(q.name) == 1 else f"{q.parent.name}/{q.name}"): RunSource(q) for q in found}


def overlay(runs: dict[str, RunSource], key: str, smoothing: float = 0.0) -> pd.DataFrame:
    """Columns step, value, series (the run's name): `key` of every run that logged it (smoothed, except the
    held-out evaluations)."""
    parts = []
    for name, src in runs.items():
        if key.startswith("eval/"):
            records = [{"step": s, key: m.get(key[5:])} for s, m in run_eval_points(src)]
        else:
            records = src.metrics()
        frame = long_frame(records, [key], smoothing=0.0 if key.startswith("eval/") else smoothing)  # a few
        # evaluations are points in their own right, never smoothed
        frame["series"] = name
        parts.append(frame)
    out = pd.concat(parts, ignore_index=True) if parts else long_frame([], [])
    return out.astype({"series": "str"})


def compare_rows(runs: dict[str, RunSource]) -> tuple[list[str], list[list]]:
    """(headers, rows): one row per run with its kind, steps, smoothed headline metrics and latest evaluation."""
    headers = ["run", "kind", "steps", "reward", "tIoU", "loss", "eval step", *[label for _, label in EVAL_KEYS]]
    rows = []
    for name, src in runs.items():
        metrics = src.metrics()
        try:
            kind = src.reader().info().get("kind")
        except UserError:
            kind = None
        heads = [trend(metrics, k) for k in ("reward/mean", "reward/iou", "sft/loss")]
        points = run_eval_points(src)
        last_step, last = points[-1] if points else (None, {})
        rows.append([name, kind or "", len(metrics), *[None if t is None else round(t["now"], 3) for t in heads],
                     last_step, *[None if not isinstance(last.get(k), (int, float)) else round(last[k], 3)
                                  for k, _ in EVAL_KEYS]])
    return headers, rows
