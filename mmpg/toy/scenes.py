"""What each synthetic video shows: its frame rate, size, duration and 1-3 events, drawn from the video's own rng.

An event is one object of a named colour and shape, drawn ONLY while `start <= frame_index / fps < end` (the
annotated span, seconds) and not at all outside it. Motions:

    appears                          stays still where it appeared
    left_to_right, right_to_left,    the centre moves linearly from `centre_start` (at `start`) to
    top_to_bottom, bottom_to_top     `centre_end` (at `end`)
    changes_colour                   stays still; drawn in `colour` before the span midpoint
                                     (start + end) / 2 and in `to_colour` from the midpoint on

Every colour (including `to_colour`) is used by at most one event of a video, so a pixel colour identifies its
event. Each event owns one column of the frame (k events -> k equal columns), so objects never overlap even when
spans do. Spans last >= MIN_SPAN_S and lie inside [0, duration]. The easy scene (`easy_scene`) is the one a tiny
model learns on a CPU: one large white shape, still, in the middle of a black 64x64 frame at 2 fps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from mmpg.toy import render

MIN_SPAN_S = 2.0
MAX_EVENTS = 3
MOTIONS: tuple[str, ...] = (
    "appears", "left_to_right", "right_to_left", "top_to_bottom", "bottom_to_top", "changes_colour",
)


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
class Scene:
    """Everything needed to draw one video; `duration == n_frames / fps` (rounded to ms)."""

    video_id: str
    fps: float
    width: int
    height: int
    n_frames: int
    duration: float
    events: tuple[Event, ...]
    # an easy scene with queries > 1: the video's one event asked about in several wordings (each its own query, the
    # same span), as several annotators describe one moment of a Charades-STA video; () = each event's sentence
    phrasings: tuple[str, ...] = ()


def random_scene(rng: np.random.Generator, video_id: str, min_duration: float, max_duration: float,
                 sizes: Sequence[tuple[int, int]], fps_choices: Sequence[float]) -> Scene:
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
        events.append(_random_event(rng, names.pop(0), motion, to_colour, duration, region, (width, height)))
    events.sort(key=lambda e: (e.start, e.end))
    return Scene(video_id, fps, width, height, n_frames, duration, tuple(events))


EASY_FPS, EASY_SIZE = 2.0, 64
EASY_PHRASINGS = ("a white {shape} appears", "the white {shape} is visible", "a {shape} is shown",
                  "the {shape} can be seen", "a bright {shape} shows up")


def easy_scene(rng: np.random.Generator, video_id: str, min_duration: float, max_duration: float,
               queries: int = 1) -> Scene:
    """One large white circle or square in the middle of a black 64x64 frame, 2 fps, whole-second duration and span
    (2 s to 60 % of the duration). queries > 1: 2..queries wordings of it (`EASY_PHRASINGS`), drawn from the rng
    last, so the video itself does not depend on `queries`."""
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
    return Scene(video_id, EASY_FPS, EASY_SIZE, EASY_SIZE, int(duration * EASY_FPS), float(duration), (event,),
                 phrasings)


def _random_event(rng: np.random.Generator, colour: str, motion: str, to_colour: str | None,
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
