"""`RunWriter`: everything training (or the evaluator) writes into a run directory, from rank 0 only.

    writer = RunWriter(run_dir, rank=rank)          # rank != 0: every method is a no-op
    writer.start(config_yaml, kind="grpo", command=sys.argv, resume_step=None | k)
    for step in ...:
        key = writer.write_thumbnails(video, frames, times)   # once per video (later calls return at once)
        writer.write_rollouts(step, [GroupRecord(..., media_key=key, responses=[...]), ...])
        writer.log_metrics(step, {"reward/mean": ..., "timing_s/rollout": ...})
    writer.log_eval(step, {"eval/r1@0.5": ...})
    writer.close()

The file formats are described once, in `mmpg.runs.layout`.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import numbers
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from mmpg.runs.files import (
    append_line,
    atomic_write_json,
    atomic_write_jsonl,
    atomic_write_text,
    jsonable,
    read_jsonl,
    repair_tail,
)
from mmpg.runs.layout import (
    CONFIG_YAML,
    EVAL_JSONL,
    KINDS,
    LAYOUT_VERSION,
    MEDIA_DIR,
    MEDIA_META,
    METRICS_JSONL,
    ROLLOUTS_DIR,
    RUN_JSON,
    TB_DIR,
    TEMP_PREFIX,
    rollout_path,
    rollout_step,
    media_key,
)
from mmpg.runs.records import GroupRecord

log = logging.getLogger("mmpg.runs")

_RESERVED = ("v", "step", "time")  # keys of a metrics line that are not metrics


class _TensorBoard:
    """Scalars to RUN_DIR/tb through torch's SummaryWriter, imported only here and only when first used."""

    def __init__(self, log_dir: Path, purge_step: int | None):
        self.log_dir, self.purge_step, self._writer, self._failed = log_dir, purge_step, None, False

    def scalars(self, step: int, metrics: Mapping[str, object], prefix: str = "") -> None:
        if self._failed:
            return
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is a dependency; a broken install must not stop training
                log.warning("TensorBoard logging disabled: %s", e)
                self._failed = True
                return
            # purge_step hides events of steps >= purge_step left by the killed run we resume.
            self._writer = SummaryWriter(str(self.log_dir), purge_step=self.purge_step, flush_secs=30)
        for name, value in metrics.items():
            value = jsonable(value)  # numpy / torch scalars to Python numbers, NaN to None (not plotted)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                tag = name if not prefix or name.startswith(prefix) else prefix + name
                self._writer.add_scalar(tag, float(value), global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _truncate_jsonl(path: Path, resume_step: int) -> int:
    """Rewrite `path` atomically without the lines of steps > resume_step; returns how many were dropped."""
    if not path.exists():
        return 0
    records = read_jsonl(path)  # also drops a cut-short last line
    kept = [r for r in records if not (isinstance(r.get("step"), int) and r["step"] > resume_step)]
    atomic_write_jsonl(path, kept)
    return len(records) - len(kept)


def _check_frame(i: int, frame) -> np.ndarray:
    a = np.asarray(frame)
    if a.ndim != 3 or a.shape[2] != 3 or a.dtype != np.uint8:
        raise ValueError(f"thumbnail frame {i} must be an HxWx3 uint8 array, got shape {a.shape} dtype {a.dtype}")
    return np.ascontiguousarray(a)


class RunWriter:
    """Writes one run directory. Only `rank == 0` touches the disk; other ranks get the same calls as no-ops."""

    def __init__(self, run_dir: str | os.PathLike, *, rank: int = 0, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.active = rank == 0
        self.tensorboard = tensorboard
        self._tb: _TensorBoard | None = None
        self._checked: set[str] = set()  # JSONL files whose tail was checked before the first append

    # ----------------------------------------------------------------------------------------------- set-up
    def start(
        self,
        config_yaml: str,
        kind: str,
        command: Sequence[str] | None = None,
        resume_step: int | None = None,
        extra: dict | None = None,
    ) -> None:
        """Create the folder, write run.json (first start only) and config.yaml; on resume drop steps > resume_step.

        `command` defaults to sys.argv. `resume_step` is the step of the checkpoint being resumed: metric and eval
        lines and rollout files of later steps (written by the killed run after that checkpoint) are removed, and
        TensorBoard hides its events of those steps. `extra`: more run.json keys (e.g. "parameters", the
        trainable-parameter counts); a resumed run adds those its run.json lacks.
        """
        if kind not in KINDS:
            raise ValueError(f"RunWriter.start: kind must be one of {KINDS}, got {kind!r}")
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_json = self.run_dir / RUN_JSON
        if not run_json.exists():
            atomic_write_json(run_json, {**self._run_info(kind, command), **(extra or {})})
        elif extra:
            self._add_run_info(run_json, extra)
        atomic_write_text(self.run_dir / CONFIG_YAML, config_yaml)
        if resume_step is not None:
            self._truncate_after(int(resume_step))
        if self.tensorboard:
            if self._tb is not None:
                self._tb.close()
            self._tb = _TensorBoard(self.run_dir / TB_DIR, None if resume_step is None else int(resume_step) + 1)

    def _run_info(self, kind: str, command: Sequence[str] | None) -> dict:
        from mmpg import __version__

        return {
            "layout_version": LAYOUT_VERSION,
            "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "mmpg_version": __version__,
            "command": [str(c) for c in (sys.argv if command is None else command)],
            "kind": kind,
        }

    @staticmethod
    def _add_run_info(run_json: Path, extra: dict) -> None:
        """Keys of `extra` that run.json (written by an earlier start) does not have yet."""
        try:
            info = json.loads(run_json.read_text(encoding="utf-8"))
        except ValueError:
            return  # a damaged run.json is the reader's error to report, not the writer's to hide
        missing = {k: v for k, v in extra.items() if k not in info}
        if missing:
            atomic_write_json(run_json, {**info, **missing})

    def set_fast_paths(self, fast_paths: Mapping[str, object]) -> None:
        """run.json's "fast_paths" := `fast_paths` ({path: {"value", "why"}}, `mmpg.choices.current()`: what each
        fast path chose and why), the rest of run.json kept; written atomically (rank 0; others do nothing)."""
        if not self.active:
            return
        run_json = self.run_dir / RUN_JSON
        try:
            info = json.loads(run_json.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # a missing or damaged run.json is the reader's error to report, not the writer's to hide
        atomic_write_json(run_json, {**info, "fast_paths": jsonable(dict(fast_paths))})

    def _truncate_after(self, resume_step: int) -> None:
        dropped = sum(_truncate_jsonl(self.run_dir / name, resume_step) for name in (METRICS_JSONL, EVAL_JSONL))
        removed = 0
        rollouts = self.run_dir / ROLLOUTS_DIR
        if rollouts.is_dir():
            for p in rollouts.iterdir():
                step = rollout_step(p.name)
                if step is not None and step > resume_step:
                    p.unlink()
                    removed += 1
        if dropped or removed:
            log.info(
                "resuming at step %d: dropped %d metric/eval lines and %d rollout files of later steps",
                resume_step, dropped, removed,
            )

    # ------------------------------------------------------------------------------------------- JSON lines
    def _append(self, name: str, step: int, metrics: Mapping[str, object]) -> None:
        if not isinstance(step, numbers.Integral) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        clash = [k for k in metrics if k in _RESERVED]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in {name}; rename them (e.g. 'train/{clash[0]}')")
        path = self.run_dir / name
        if name not in self._checked:  # a killed writer may have left half a line: cut it before appending
            self.run_dir.mkdir(parents=True, exist_ok=True)
            repair_tail(path)
            self._checked.add(name)
        append_line(path, {"v": LAYOUT_VERSION, "step": int(step), "time": round(time.time(), 3), **metrics})

    def log_metrics(self, step: int, metrics: Mapping[str, object]) -> None:
        """Append one line to metrics.jsonl (whole, fsynced) and the numeric scalars to TensorBoard."""
        if not self.active:
            return
        self._append(METRICS_JSONL, step, metrics)
        self._scalars(step, metrics)

    def log_eval(self, step: int, metrics: Mapping[str, object]) -> None:
        """Append one line to eval.jsonl; TensorBoard tags get an "eval/" prefix unless they have it."""
        if not self.active:
            return
        self._append(EVAL_JSONL, step, metrics)
        self._scalars(step, metrics, prefix="eval/")

    def _scalars(self, step: int, metrics: Mapping[str, object], prefix: str = "") -> None:
        """The numeric scalars to TensorBoard (its writer made on first use), when on."""
        if self._tb is None and self.tensorboard:
            self._tb = _TensorBoard(self.run_dir / TB_DIR, None)
        if self._tb is not None:
            self._tb.scalars(int(step), metrics, prefix=prefix)

    # -------------------------------------------------------------------------------------- rollouts, media
    def write_rollouts(self, step: int, groups: Sequence[GroupRecord]) -> Path | None:
        """Write rollouts/step_%08d.jsonl (one GroupRecord per line) atomically; replaces an earlier file."""
        if not self.active:
            return None
        bad = [type(g).__name__ for g in groups if not isinstance(g, GroupRecord)]
        if bad:
            raise TypeError(f"write_rollouts takes GroupRecord objects, got {bad[0]}")
        return atomic_write_jsonl(rollout_path(self.run_dir, step), [g.to_json() for g in groups])

    def write_thumbnails(
        self, video_path: str | os.PathLike, frames: Sequence[np.ndarray], times: Sequence[float], quality: int = 85
    ) -> str:
        """JPEG thumbnails of a video under media/<media_key>/, written once; returns the key on every rank.

        frames: [T] arrays HxWx3 uint8 (RGB); times: [T] seconds of each frame in the video. Skipped when
        media/<key>/meta.json exists. Written into a temp folder renamed into place, so readers see all or nothing.
        """
        key = media_key(video_path)
        if not self.active:
            return key
        media = self.run_dir / MEDIA_DIR
        final = media / key
        if (final / MEDIA_META).exists():
            return key
        if len(frames) != len(times):
            raise ValueError(f"write_thumbnails: {len(frames)} frames but {len(times)} times for {video_path}")
        arrays = [_check_frame(i, f) for i, f in enumerate(frames)]
        from PIL import Image

        tmp = media / f"{TEMP_PREFIX}{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        names = [f"frame_{i:02d}.jpg" for i in range(len(arrays))]
        for name, a in zip(names, arrays):
            Image.fromarray(a).save(tmp / name, format="JPEG", quality=quality)
        times = [float(t) if math.isfinite(float(t)) else None for t in times]
        meta = {"v": LAYOUT_VERSION, "video": os.fspath(video_path), "times": times, "frames": names}
        atomic_write_json(tmp / MEDIA_META, meta)
        if final.exists() and not (final / MEDIA_META).exists():  # not ours: a finished write has meta.json
            shutil.rmtree(final)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / MEDIA_META).exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process wrote the same video's thumbnails first
        return key

    # ------------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
