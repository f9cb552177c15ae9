"""`RunReader`: read a run directory (possibly while it is being written) for the app, the evaluator and plots.

    run = RunReader("runs/charades_grpo")
    steps, rewards = metric_series(run.metrics(), "reward/mean")
    for step in run.steps():                       # re-listed on each call: new steps appear as the run writes
        groups = run.rollouts(step)                # [GroupRecord]
        frames, times = run.thumbnails(groups[0].media_key)

Every path a caller builds from user input goes through `resolve`, which refuses to leave the run directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from mmpg.errors import UserError
from mmpg.runs.checkpoints import list_checkpoints
from mmpg.runs.files import read_jsonl, resolve_inside
from mmpg.runs.layout import (
    CONFIG_YAML,
    EVAL_JSONL,
    LAYOUT_VERSION,
    MEDIA_DIR,
    MEDIA_META,
    METRICS_JSONL,
    ROLLOUTS_DIR,
    RUN_JSON,
    is_safe_key,
    rollout_path,
    rollout_step,
)
from mmpg.runs.records import GroupRecord


def _last_per_step(records: list[dict]) -> list[dict]:
    """One record per step (the last one written), by step; records without an int step are left out."""
    by_step = {}
    for r in records:
        step = r.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            by_step[step] = r
    return [by_step[s] for s in sorted(by_step)]


def metric_series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric across records, skipping records where it is missing or null (NaN)."""
    steps, values = [], []
    for r in records:
        value = r.get(key)
        if value is not None and "step" in r:
            steps.append(r["step"])
            values.append(value)
    return steps, values


class RunReader:
    """Read-only view of a run directory. Raises UserError if `run_dir` is not one."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise UserError(f"{self.run_dir}: no such folder; pass a run directory (the folder a training run wrote)")
        if not (self.run_dir / RUN_JSON).is_file() and not (self.run_dir / METRICS_JSONL).is_file():
            raise UserError(
                f"{self.run_dir} is not a run directory (it has neither {RUN_JSON} nor {METRICS_JSONL}); "
                "pass the folder a training run wrote"
            )
        version = self.info().get("layout_version", LAYOUT_VERSION)
        if isinstance(version, int) and version > LAYOUT_VERSION:
            raise UserError(
                f"{self.run_dir}: written with run layout version {version}, this mmpg reads up to "
                f"{LAYOUT_VERSION}; upgrade mmpg"
            )

    def info(self) -> dict:
        """run.json as a dict ({} for a run directory that has only metrics.jsonl)."""
        path = self.run_dir / RUN_JSON
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise UserError(f"{path}: not valid JSON ({e}); the file is damaged") from None

    def config(self) -> dict:
        """config.yaml parsed with yaml.safe_load ({} if absent)."""
        path = self.run_dir / CONFIG_YAML
        if not path.is_file():
            return {}
        try:
            return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise UserError(f"{path}: not valid YAML ({e})") from None

    def metrics(self) -> list[dict]:
        """metrics.jsonl, one record per step (the last if a step appears twice), by step."""
        path = self.run_dir / METRICS_JSONL
        return _last_per_step(read_jsonl(path)) if path.is_file() else []

    def eval_metrics(self) -> list[dict]:
        """eval.jsonl, one record per step (the last if a step appears twice), by step."""
        path = self.run_dir / EVAL_JSONL
        return _last_per_step(read_jsonl(path)) if path.is_file() else []

    def steps(self) -> list[int]:
        """Steps that have a rollout file, ascending (listed afresh on each call)."""
        root = self.run_dir / ROLLOUTS_DIR
        if not root.is_dir():
            return []
        return sorted(s for s in (rollout_step(p.name) for p in root.iterdir()) if s is not None)

    def rollouts(self, step: int) -> list[GroupRecord]:
        """The groups of one step, in the order they were written."""
        path = rollout_path(self.run_dir, step)
        if not path.is_file():
            raise UserError(f"{self.run_dir}: no rollouts for step {step}; steps with rollouts: {self.steps()}")
        out = []
        for i, d in enumerate(read_jsonl(path)):
            try:
                out.append(GroupRecord.from_json(d))
            except (TypeError, ValueError) as e:
                raise UserError(f"{path}: group {i}: {e}") from None
        return out

    def thumbnails(self, media_key: str | None) -> tuple[list[Path], list[float]]:
        """(JPEG paths, seconds of each) for a GroupRecord.media_key; ([], []) if none were written (yet)."""
        if not media_key:
            return [], []
        if not is_safe_key(media_key):
            raise UserError(f"{media_key!r} is not a media key (one name made of letters, digits, '_', '-', '.')")
        folder = self.resolve(f"{MEDIA_DIR}/{media_key}")
        meta_path = folder / MEDIA_META
        if not meta_path.is_file():
            return [], []
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        times = [float("nan") if t is None else float(t) for t in meta.get("times", [])]
        names = meta.get("frames") or [f"frame_{i:02d}.jpg" for i in range(len(times))]
        return [self.resolve(f"{MEDIA_DIR}/{media_key}/{n}") for n in names], times

    def checkpoints(self) -> list[tuple[int, Path]]:
        """[(step, folder)] of the complete checkpoints, by step."""
        return list_checkpoints(self.run_dir)

    def resolve(self, relpath: str | os.PathLike) -> Path:
        """The real path of `relpath` inside the run directory; UserError for anything that would leave it
        (an absolute path, '..', or a symlink pointing outside)."""
        return resolve_inside(self.run_dir, relpath, "the run directory")
