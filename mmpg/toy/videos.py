"""Synthetic temporal-grounding datasets with exact ground truth, for tests, the demo and smoke runs.

`generate_dataset(out, n, seed)` writes

    out/videos/<video_id>.mp4       H.264 yuv420p, one video stream, byte-deterministic
    out/{train,val,test}.json       {video_id: {"duration", "timestamps": [[s, e], ...], "sentences": [...]}}
    out/events.json                 machine-readable truth per video (see `_video_truth`)

What a video shows (its events, their spans and motions) is `mmpg.toy.scenes`; how a frame is painted and encoded
is `mmpg.toy.render`. Determinism: video i uses `default_rng(seed).spawn(n)[i]`, the split uses `default_rng(seed)`;
no clock or global randomness, so the same (n, seed, parameters) give the same bytes in every file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from mmpg.errors import UserError
from mmpg.toy import render
from mmpg.toy.scenes import EASY_PHRASINGS, MIN_SPAN_S, Scene, easy_scene, random_scene

SPLIT_NAMES = ("train", "val", "test")


def generate_dataset(
    out: Path | str,
    n: int,
    seed: int = 0,
    *,
    overwrite: bool = False,
    min_duration: float = 8.0,
    max_duration: float = 90.0,
    sizes: Sequence[tuple[int, int]] = ((320, 240), (256, 192), (384, 216)),
    fps_choices: Sequence[float] = (8.0, 10.0, 12.0, 15.0),
    splits: tuple[float, float, float] = (0.7, 0.15, 0.15),
    easy: bool = False,
    queries: int = 1,
) -> dict:
    """Write n synthetic videos plus annotations into `out`; return a summary (counts, paths).

    easy: the task a tiny model can learn on a CPU in minutes — one large white circle or square on black, in the
    middle of a 64x64 frame at 2 fps, visible only while start <= t < end; whole-second durations (min..max) and
    spans (2 s to 60 % of the duration); `sizes` and `fps_choices` are then ignored. queries (easy only): each
    video asked about in 2..queries wordings of its one moment (1: one query per video).

    Everything is written to a hidden sibling folder first and renamed into place at the end, so a
    failure or Ctrl-C never leaves a half-written `out` (with overwrite, the old folder is removed
    only after the new one is complete). Bad arguments raise `UserError` before anything is written.
    """
    out = Path(os.path.abspath(Path(out).expanduser()))  # "." has no name or parent to rename into
    _check_args(n, seed, min_duration, max_duration, sizes, fps_choices, splits)
    if queries != 1 and not (easy and 2 <= queries <= len(EASY_PHRASINGS)):
        raise UserError(f"queries={queries!r}: several queries per video are made for --easy videos only, 2 to "
                        f"{len(EASY_PHRASINGS)} (the wordings of their one moment); pass --easy or --queries 1")
    _check_out(out, overwrite)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # a stale one from a crashed run with our pid
    try:
        scenes, split_counts = _write_all(tmp, n, seed, min_duration, max_duration, sizes, fps_choices, splits,
                                          easy, queries)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _dataset_summary(out, scenes, split_counts)


def _check_args(n, seed, min_duration, max_duration, sizes, fps_choices, splits) -> None:
    """Raise UserError (one line: what is wrong and what to do) for arguments we cannot honour."""
    if not isinstance(n, (int, np.integer)) or n <= 0:
        raise UserError(f"n={n!r} must be a positive number of videos; pass --n 1 or more")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UserError(f"seed={seed!r} must be a non-negative integer; pass --seed 0 or higher")
    if not min_duration >= MIN_SPAN_S:
        raise UserError(f"min_duration={min_duration!r} s is too short: events last at least {MIN_SPAN_S} s; "
                        f"pass --min-duration {MIN_SPAN_S} or more")
    if not min_duration <= max_duration:
        raise UserError(f"min_duration={min_duration!r} s is larger than max_duration={max_duration!r} s; "
                        "pass --min-duration <= --max-duration")
    if not max_duration < float("inf"):
        raise UserError(f"max_duration={max_duration!r} s is not a finite number of seconds; pass e.g. 90")
    if not sizes or any(len(s) != 2 or s[0] < 16 or s[1] < 16 or s[0] % 2 or s[1] % 2 for s in sizes):
        raise UserError(f"sizes={list(sizes)!r} must be (width, height) pairs, both even and >= 16 "
                        "(H.264 yuv420p needs even sizes)")
    if not fps_choices or any(not f > 0 for f in fps_choices):
        raise UserError(f"fps_choices={list(fps_choices)!r} must be positive frame rates")
    if len(splits) != 3 or any(not f >= 0 for f in splits) or abs(sum(splits) - 1.0) > 1e-6:
        raise UserError(f"splits={tuple(splits)!r} must be three fractions >= 0 (train, val, test) summing to 1")


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an `out` we would clobber by accident; see generate_dataset for the overwrite rules."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a folder; choose another --out")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError(f"{parent} (above {out}) is a file, not a folder; choose another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(f"{out} is not empty; pass --overwrite or choose another folder")
    resolved, cwd = out.resolve(), Path.cwd().resolve()
    if resolved in (Path(resolved.anchor), Path.home().resolve()) or resolved == cwd or resolved in cwd.parents:
        raise UserError(f"refusing to overwrite {out} (the root, home or current folder or one above it); "
                        "choose a dedicated --out folder")


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; an old `out` is removed only once `tmp` is in place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if not any(out.iterdir()):
        _move_children(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)  # put the user's folder back before reporting the failure
        raise
    shutil.rmtree(old)


def _move_children(tmp: Path, out: Path) -> None:
    """Fill an existing empty `out` without replacing the folder itself: it may be a mount point, a
    symlink or the caller's current folder. Undone (out emptied again) if a rename fails."""
    moved = []
    try:
        for child in sorted(tmp.iterdir()):
            os.replace(child, out / child.name)
            moved.append(out / child.name)
    except BaseException:
        for path in moved:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        raise
    tmp.rmdir()


def _write_all(tmp, n, seed, min_duration, max_duration, sizes, fps_choices, splits, easy=False, queries=1):
    """Draw, paint and encode every video into `tmp`, then write the JSON files.

    Returns (scenes, {split name: number of videos}).
    """
    (tmp / "videos").mkdir(parents=True)
    width = max(5, len(str(n - 1)))
    rngs = np.random.default_rng(seed).spawn(n)
    scenes = []
    for i, rng in enumerate(rngs):
        vid = f"synth_{i:0{width}d}"
        scene = easy_scene(rng, vid, min_duration, max_duration, queries) if easy else \
            random_scene(rng, vid, min_duration, max_duration, sizes, fps_choices)
        _encode_scene(tmp / "videos" / f"{scene.video_id}.mp4", scene, rng, black=easy)
        scenes.append(scene)
    assignment = split_ids([sc.video_id for sc in scenes], splits, np.random.default_rng(seed))
    by_id = {sc.video_id: sc for sc in scenes}
    for name, ids in assignment.items():
        _write_json(tmp / f"{name}.json", {vid: _annotation(by_id[vid]) for vid in ids})
    _write_json(tmp / "events.json", {sc.video_id: _video_truth(sc) for sc in scenes})
    return scenes, {name: len(ids) for name, ids in assignment.items()}


def _encode_scene(path: Path, scene: Scene, rng: np.random.Generator, black: bool = False) -> None:
    """Draw the background from the video's rng (or plain black) and encode every frame of `scene` to `path`."""
    background = np.zeros((scene.height, scene.width, 3), np.uint8) if black else \
        render.make_background(rng, scene.width, scene.height)
    planes = render.background_planes(background)

    def frames() -> Iterator[np.ndarray]:
        for i in range(scene.n_frames):
            t = i / scene.fps
            sprites = [s for s in (e.sprite_at(t) for e in scene.events) if s is not None]
            yield render.render_frame(planes, sprites)

    written = render.encode_video(path, frames(), scene.width, scene.height, scene.fps)
    assert written == scene.n_frames, f"{path}: wrote {written} frames, expected {scene.n_frames}"


def split_ids(ids: Sequence[str], fractions: Sequence[float], rng: np.random.Generator) -> dict[str, list[str]]:
    """Shuffle ids into train/val/test by `fractions`; each split with a positive fraction gets >= 1
    id when there are >= 3 ids, and everything goes to train below 3. Ids are sorted inside a split."""
    n = len(ids)
    if n < 3:
        return {"train": sorted(ids), "val": [], "test": []}
    counts = [round(n * f) for f in fractions]
    counts = [max(c, 1) if f > 0 else c for c, f in zip(counts, fractions)]
    while sum(counts) > n:  # the forced 1s overshot: take from the largest split
        counts[int(np.argmax(counts))] -= 1
    counts[int(np.argmax(fractions))] += n - sum(counts)  # rounding leftovers go to the biggest split
    order = [ids[i] for i in rng.permutation(n)]
    bounds = np.cumsum([0] + counts)
    return {name: sorted(order[bounds[j]:bounds[j + 1]]) for j, name in enumerate(SPLIT_NAMES)}


def _annotation(scene: Scene) -> dict:
    """Charades-STA / ActivityNet-Captions style entry for one video."""
    if scene.phrasings:
        (e,) = scene.events
        return {"duration": scene.duration, "timestamps": [[e.start, e.end] for _ in scene.phrasings],
                "sentences": list(scene.phrasings)}
    return {
        "duration": scene.duration,
        "timestamps": [[e.start, e.end] for e in scene.events],
        "sentences": [e.sentence() for e in scene.events],
    }


def _video_truth(scene: Scene) -> dict:
    """events.json entry: what was drawn, in enough detail for tests to check pixels."""
    events = []
    for e in scene.events:
        events.append({
            "colour": e.colour, "rgb": list(render.PALETTE[e.colour]),
            "to_colour": e.to_colour, "to_rgb": list(render.PALETTE[e.to_colour]) if e.to_colour else None,
            "shape": e.shape, "motion": e.motion, "start": e.start, "end": e.end, "size": e.size,
            "centre_start": list(e.centre_start), "centre_end": list(e.centre_end), "sentence": e.sentence(),
        })
    return {"duration": scene.duration, "fps": scene.fps, "width": scene.width, "height": scene.height,
            "n_frames": scene.n_frames, "events": events}


def _write_json(path: Path, obj: dict) -> None:
    """Pretty but compact JSON: dicts one key a line, lists (spans, colours, points) on one line."""
    path.write_text(_dumps(obj) + "\n", encoding="utf-8")


def _dumps(obj, indent: str = "") -> str:
    """json.dumps where non-empty dicts and lists of dicts are broken into lines, other lists are not."""
    inner = indent + "  "
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        return "[\n" + ",\n".join(inner + json.dumps(v) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj)


def _dataset_summary(out: Path, scenes: list[Scene], split_counts: dict[str, int]) -> dict:
    """Counts and paths for the CLI to print."""
    return {
        "out": str(out),
        "n_videos": len(scenes),
        "n_events": sum(len(sc.events) for sc in scenes),
        "n_queries": sum(len(sc.phrasings) or len(sc.events) for sc in scenes),
        "total_duration_s": round(sum(sc.duration for sc in scenes), 3),
        "splits": split_counts,
        "files": {"videos": str(out / "videos"), "events": str(out / "events.json"),
                  **{name: str(out / f"{name}.json") for name in SPLIT_NAMES}},
    }
