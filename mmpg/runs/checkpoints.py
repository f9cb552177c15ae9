"""Checkpoint folders of a run: written under a temp name, marked COMPLETE, then renamed into place.

    tmp = temp_checkpoint_dir(run_dir, step)      # checkpoints/.tmp-step_00000012/
    ... the trainer saves model, optimizer, trainer state into tmp ...
    finalize_checkpoint(tmp, checkpoint_dir(run_dir, step))   # fsync files, COMPLETE last, rename
    prune_checkpoints(run_dir, keep_last=3)

Readers (`list_checkpoints`, `latest_checkpoint`) only see `step_*` folders holding COMPLETE, so a save killed
half-way is never resumed from or evaluated.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from pathlib import Path

from mmpg.runs.files import fsync_dir, atomic_write_json
from mmpg.runs.layout import CHECKPOINTS_DIR, COMPLETE, LAYOUT_VERSION, TEMP_PREFIX, step_dir_step, step_name

log = logging.getLogger("mmpg.runs")


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """RUN_DIR/checkpoints/step_%08d."""
    return Path(run_dir) / CHECKPOINTS_DIR / step_name(step)


def temp_checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """RUN_DIR/checkpoints/.tmp-step_%08d (not created here)."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"{TEMP_PREFIX}{step_name(step)}"


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE).is_file()


def mark_complete(path: str | os.PathLike) -> Path:
    """Write the COMPLETE marker into a checkpoint folder (after everything else is on disk)."""
    created = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return atomic_write_json(Path(path) / COMPLETE, {"v": LAYOUT_VERSION, "completed": created})


def _fsync_tree(path: Path) -> None:
    """Flush every file of a checkpoint to disk, so COMPLETE never lands before the data it vouches for."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def finalize_checkpoint(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """fsync the files of `tmp`, write COMPLETE into it, and rename it to `final`.

    An existing `final` (a step saved again) is first renamed aside to a temp name, so at no moment does a
    half-deleted folder with a COMPLETE marker exist; the old copy is deleted after the rename.
    """
    tmp, final = Path(tmp), Path(final)
    if not tmp.is_dir():
        raise FileNotFoundError(f"checkpoint folder {tmp} does not exist; save the checkpoint into it first")
    _fsync_tree(tmp)
    mark_complete(tmp)
    old = None
    if final.exists():
        old = final.with_name(f"{TEMP_PREFIX}old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """[(step, folder)] of the complete checkpoints, by step; temp and unmarked folders are left out."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = step_dir_step(p.name)
        if step is not None and p.is_dir() and is_complete(p):
            found.append((step, p))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> tuple[int, Path] | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete stale temp folders (.tmp-*) and all but the `keep_last` newest complete checkpoints.

    keep_last <= 0 keeps every complete checkpoint. Folders without COMPLETE that are not temp folders are never
    touched. Call it from the one process that saves, after `finalize_checkpoint`. Returns the deleted folders.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    doomed = [p for p in root.iterdir() if p.name.startswith(TEMP_PREFIX) and p.is_dir()]
    ckpts = list_checkpoints(run_dir)
    if keep_last > 0:
        doomed += [p for _, p in ckpts[: max(0, len(ckpts) - keep_last)]]
    for p in doomed:
        log.info("removing checkpoint folder %s", p)
        gone = p
        if not p.name.startswith(TEMP_PREFIX):  # renamed first: a kill mid-delete leaves a temp folder, not a
            gone = p.with_name(f"{TEMP_PREFIX}del-{p.name}")  # half-deleted one that still says COMPLETE
            os.replace(p, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return doomed
