"""Synthetic temporal-grounding videos with exact ground truth, for tests and smoke runs.

`generate_dataset(out, n, seed)` writes

    out/videos/<video_id>.mp4       H.264 yuv420p, one video stream, byte-deterministic
    out/{train,val,test}.json       {video_id: {"duration", "timestamps": [[s, e], ...], "sentences": [...]}}
    out/events.json                 machine-readable truth per video (see `_video_truth`)

Each video has a muted, gently textured background and 1-3 events. An event is one object of a
named colour and shape that is drawn ONLY while `start <= frame_index / fps < end` (the annotated
span, seconds) and not at all outside it. Motions:

    appears                          stays still where it appeared
    left_to_right, right_to_left,    the centre moves linearly from `centre_start` (at `start`) to
    top_to_bottom, bottom_to_top     `centre_end` (at `end`)
    changes_colour                   stays still; drawn in `colour` before the span midpoint
                                     (start + end) / 2 and in `to_colour` from the midpoint on

Every colour (including `to_colour`) is used by at most one event of a video, so a pixel colour
identifies its event. Each event owns one column of the frame (k events -> k equal columns), so
objects never overlap even when spans do. Spans last >= 2 s and lie inside [0, duration].

Determinism: video i uses `default_rng(seed).spawn(n)[i]`, the split uses `default_rng(seed)`; no
clock or global randomness, so the same (n, seed, parameters) give the same bytes in every file.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from mmpg.errors import UserError
from mmpg.toy import render

MIN_SPAN_S = 2.0
MAX_EVENTS = 3
MOTIONS: tuple[str, ...] = (
    "appears", "left_to_right", "right_to_left", "top_to_bottom", "bottom_to_top", "changes_colour",
)
SPLIT_NAMES = ("train", "val", "test")


@dataclass(frozen=True)
class Event:
    """One annotated event. Coordinates are luma pixels, times seconds."""

    colour: str
    shape: str
    motion: str
    start: float
    end: float
    size: float
    centre_start: tuple[float, float]
    centre_end: tuple[float, float]
    to_colour: str | None = None  # only for motion == "changes_colour"

    def sentence(self) -> str:
        """The query text, e.g. "a red circle moves from left to right"."""
        article = "an" if self.colour[0] in "aeiou" else "a"
        subject = f"{article} {self.colour} {self.shape}"
        if self.motion == "appears":
            return f"{subject} appears"
        if self.motion == "changes_colour":
            return f"{subject} turns {self.to_colour}"
        src, dst = self.motion.split("_to_")
        return f"{subject} moves from {src} to {dst}"

    def colour_at(self, t: float) -> str | None:
        """Colour name drawn at time t, or None where the event is not visible."""
        if not self.start <= t < self.end:
            return None
        if self.motion == "changes_colour" and t >= (self.start + self.end) / 2:
            return self.to_colour
        return self.colour

    def sprite_at(self, t: float) -> render.Sprite | None:
        """What to paint at time t (None outside the span)."""
        colour = self.colour_at(t)
        if colour is None:
            return None
        p = (t - self.start) / (self.end - self.start)
        (x0, y0), (x1, y1) = self.centre_start, self.centre_end
        yuv = render.colour_yuv(render.PALETTE[colour])
        return render.Sprite(self.shape, x0 + p * (x1 - x0), y0 + p * (y1 - y0), self.size, yuv)


@dataclass(frozen=True)
class VideoPlan:
    """Everything needed to draw one video; `duration == n_frames / fps` (rounded to ms)."""

    video_id: str
    fps: float
    width: int
    height: int
    n_frames: int
    duration: float
    events: tuple[Event, ...]
    # easy mode with queries > 1: the video's one event asked about in several wordings (each its own query, the
    # same span), as several annotators describe one moment of a Charades-STA video; () = each event's sentence
    phrasings: tuple[str, ...] = ()


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
    video asked about in 2..queries wordings of its one moment (1: one query per video, as before).

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
        plans, split_counts = _write_all(tmp, n, seed, min_duration, max_duration, sizes, fps_choices, splits,
                                         easy, queries)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _summary(out, plans, split_counts)


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
    """Plan, draw and encode every video into `tmp`, then write the JSON files.

    Returns (plans, {split name: number of videos}).
    """
    (tmp / "videos").mkdir(parents=True)
    width = max(5, len(str(n - 1)))
    rngs = np.random.default_rng(seed).spawn(n)
    plans = []
    for i, rng in enumerate(rngs):
        vid = f"synth_{i:0{width}d}"
        plan = plan_easy_video(rng, vid, min_duration, max_duration, queries) if easy else \
            plan_video(rng, vid, min_duration, max_duration, sizes, fps_choices)
        _encode_plan(tmp / "videos" / f"{plan.video_id}.mp4", plan, rng, black=easy)
        plans.append(plan)
    assignment = split_ids([p.video_id for p in plans], splits, np.random.default_rng(seed))
    by_id = {p.video_id: p for p in plans}
    for name, ids in assignment.items():
        _write_json(tmp / f"{name}.json", {vid: _annotation(by_id[vid]) for vid in ids})
    _write_json(tmp / "events.json", {p.video_id: _video_truth(p) for p in plans})
    return plans, {name: len(ids) for name, ids in assignment.items()}


def plan_video(rng: np.random.Generator, video_id: str, min_duration: float, max_duration: float,
               sizes: Sequence[tuple[int, int]], fps_choices: Sequence[float]) -> VideoPlan:
    """Draw frame rate, size, duration and 1-3 events for one video from its own rng."""
    fps = float(fps_choices[rng.integers(len(fps_choices))])
    width, height = (int(v) for v in sizes[rng.integers(len(sizes))])
    n_frames = max(1, round(rng.uniform(min_duration, max_duration) * fps))
    duration = round(n_frames / fps, 3)
    k = int(rng.integers(1, MAX_EVENTS + 1))
    names = [str(c) for c in rng.permutation(list(render.PALETTE))]  # distinct colours per video
    columns = rng.permutation(k)
    events = []
    for j in range(k):
        motion = str(MOTIONS[rng.integers(len(MOTIONS))])
        to_colour = names.pop() if motion == "changes_colour" else None
        region = (int(columns[j]) * width // k, 0, (int(columns[j]) + 1) * width // k, height)
        events.append(_plan_event(rng, names.pop(0), motion, to_colour, duration, region, (width, height)))
    events.sort(key=lambda e: (e.start, e.end))
    return VideoPlan(video_id, fps, width, height, n_frames, duration, tuple(events))


EASY_FPS, EASY_SIZE = 2.0, 64


EASY_PHRASINGS = ("a white {shape} appears", "the white {shape} is visible", "a {shape} is shown",
                  "the {shape} can be seen", "a bright {shape} shows up")


def plan_easy_video(rng: np.random.Generator, video_id: str, min_duration: float, max_duration: float,
                    queries: int = 1) -> VideoPlan:
    """One large white circle or square in the middle of a black 64x64 frame, 2 fps, whole seconds. queries > 1:
    2..queries wordings of it (`EASY_PHRASINGS`, drawn after everything else, so queries=1 draws what it always
    drew)."""
    duration = int(rng.integers(int(np.ceil(min_duration)), int(np.floor(max_duration)) + 1))
    longest = max(int(MIN_SPAN_S), int(0.6 * duration))
    length = int(rng.integers(int(MIN_SPAN_S), longest + 1))
    start = int(rng.integers(0, duration - length + 1))
    shape = ("circle", "square")[int(rng.integers(2))]
    centre = (EASY_SIZE / 2, EASY_SIZE / 2)
    event = Event("white", shape, "appears", float(start), float(start + length), 0.6 * EASY_SIZE, centre, centre)
    phrasings: tuple[str, ...] = ()
    if queries > 1:
        k = int(rng.integers(2, queries + 1))
        phrasings = tuple(EASY_PHRASINGS[i].format(shape=shape) for i in sorted(
            rng.choice(len(EASY_PHRASINGS), size=k, replace=False).tolist()))
    return VideoPlan(video_id, EASY_FPS, EASY_SIZE, EASY_SIZE, int(duration * EASY_FPS), float(duration), (event,),
                     phrasings)


def _plan_event(rng: np.random.Generator, colour: str, motion: str, to_colour: str | None,
                duration: float, region: tuple[int, int, int, int], frame: tuple[int, int]) -> Event:
    """Span (>= MIN_SPAN_S, inside the video, rounded to 10 ms) and path inside `region` for one event."""
    # Round the length up and the start down to 10 ms so the span stays >= MIN_SPAN_S and <= duration.
    length = min(np.ceil(rng.uniform(MIN_SPAN_S, max(MIN_SPAN_S, 0.5 * duration)) * 100), np.floor(duration * 100))
    start_cs = np.floor(rng.uniform(0.0, duration * 100 - length))
    start, end = round(float(start_cs) / 100, 2), round(float(start_cs + length) / 100, 2)
    x0, y0, x1, y1 = region
    size = float(max(8, round(min(0.22 * min(frame), 0.8 * min(x1 - x0, y1 - y0)))))
    lo_x, hi_x, lo_y, hi_y = x0 + size / 2, x1 - size / 2, y0 + size / 2, y1 - size / 2
    here = (round(float(rng.uniform(lo_x, hi_x)), 1), round(float(rng.uniform(lo_y, hi_y)), 1))
    paths = {
        "left_to_right": ((lo_x, here[1]), (hi_x, here[1])),
        "right_to_left": ((hi_x, here[1]), (lo_x, here[1])),
        "top_to_bottom": ((here[0], lo_y), (here[0], hi_y)),
        "bottom_to_top": ((here[0], hi_y), (here[0], lo_y)),
    }
    centre_start, centre_end = paths.get(motion, (here, here))
    shape = str(render.SHAPES[rng.integers(len(render.SHAPES))])
    return Event(colour, shape, motion, start, end, size, centre_start, centre_end, to_colour)


def _encode_plan(path: Path, plan: VideoPlan, rng: np.random.Generator, black: bool = False) -> None:
    """Draw the background from the video's rng (or plain black) and encode every frame of `plan` to `path`."""
    background = np.zeros((plan.height, plan.width, 3), np.uint8) if black else \
        render.make_background(rng, plan.width, plan.height)
    planes = render.background_planes(background)

    def frames() -> Iterator[np.ndarray]:
        for i in range(plan.n_frames):
            t = i / plan.fps
            sprites = [s for s in (e.sprite_at(t) for e in plan.events) if s is not None]
            yield render.render_frame(planes, sprites)

    written = render.encode_video(path, frames(), plan.width, plan.height, plan.fps)
    assert written == plan.n_frames, f"{path}: wrote {written} frames, planned {plan.n_frames}"


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


def _annotation(plan: VideoPlan) -> dict:
    """Charades-STA / ActivityNet-Captions style entry for one video."""
    if plan.phrasings:
        (e,) = plan.events
        return {"duration": plan.duration, "timestamps": [[e.start, e.end] for _ in plan.phrasings],
                "sentences": list(plan.phrasings)}
    return {
        "duration": plan.duration,
        "timestamps": [[e.start, e.end] for e in plan.events],
        "sentences": [e.sentence() for e in plan.events],
    }


def _video_truth(plan: VideoPlan) -> dict:
    """events.json entry: what was drawn, in enough detail for tests to check pixels."""
    events = []
    for e in plan.events:
        events.append({
            "colour": e.colour, "rgb": list(render.PALETTE[e.colour]),
            "to_colour": e.to_colour, "to_rgb": list(render.PALETTE[e.to_colour]) if e.to_colour else None,
            "shape": e.shape, "motion": e.motion, "start": e.start, "end": e.end, "size": e.size,
            "centre_start": list(e.centre_start), "centre_end": list(e.centre_end), "sentence": e.sentence(),
        })
    return {"duration": plan.duration, "fps": plan.fps, "width": plan.width, "height": plan.height,
            "n_frames": plan.n_frames, "events": events}


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


def _summary(out: Path, plans: list[VideoPlan], split_counts: dict[str, int]) -> dict:
    """Counts and paths for the CLI to print."""
    return {
        "out": str(out),
        "n_videos": len(plans),
        "n_events": sum(len(p.events) for p in plans),
        "n_queries": sum(len(p.phrasings) or len(p.events) for p in plans),
        "total_duration_s": round(sum(p.duration for p in plans), 3),
        "splits": split_counts,
        "files": {"videos": str(out / "videos"), "events": str(out / "events.json"),
                  **{name: str(out / f"{name}.json") for name in SPLIT_NAMES}},
    }
