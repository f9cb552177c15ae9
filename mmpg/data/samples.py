"""The one sample type every annotation format becomes, and how its video file is found.

Times are seconds from the start of the *whole* video file. An optional clip window (`clip_start`, `clip_end`)
restricts which frames the model is shown; the span and the expected answer stay in whole-video seconds, and the
prompt states the window.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import NamedTuple

# Tried in this order when an annotation names a video without an extension (Charades ids, ActivityNet ids).
VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov")
# Suffixes that mean "this name already carries its extension" (the list above plus a few more containers).
_KNOWN_SUFFIXES = frozenset(VIDEO_EXTENSIONS + (".m4v", ".mpg", ".mpeg", ".flv", ".wmv", ".3gp", ".ts"))


@dataclasses.dataclass(frozen=True)
class GroundingSample:
    """One (video, sentence, moment) triple.

    sample_id: unique within a dataset, e.g. `3MSZA#0` or `v_QOlSCBRmfWY#2` (video id, `#`, sentence index).
    video: path of the video file (resolved against the video folder; it may not exist, which `check-data` reports).
    duration: seconds of the whole video, or None until read from the file (`fill_durations`, or the dataset).
    query: the sentence describing the moment.
    span: (start, end) of the moment in seconds, start < end.
    clip_start / clip_end: optional window of the video shown to the model (seconds); None = whole video.
    origin: where the sample came from, `file:line` or `file[index]`, for error messages.
    """

    sample_id: str
    video: str
    duration: float | None
    query: str
    span: tuple[float, float]
    clip_start: float | None = None
    clip_end: float | None = None
    origin: str = ""

    @property
    def where(self) -> str:
        """`origin (sample id)` — what an error message names."""
        return f"{self.origin} (sample {self.sample_id})" if self.origin else f"sample {self.sample_id}"

    def with_duration(self, duration: float) -> GroundingSample:
        return dataclasses.replace(self, duration=float(duration))


class Skip(NamedTuple):
    """A sample or line left out: where it was (`file:line`, `file[index]`, or a sample) and why."""

    where: str
    reason: str


@dataclasses.dataclass
class LoadResult:
    """What a loader returns: the usable samples and the (where, reason) of everything it left out."""

    samples: list[GroundingSample]
    skipped: list[Skip] = dataclasses.field(default_factory=list)


def resolve_video(video_dir: str | Path | None, name: str, _cache: dict | None = None) -> str:
    """Path of the video called `name` (an id, a file name, or a relative/absolute path).

    A name without a known video extension gets `.mp4 .mkv .webm .avi .mov` tried in order, then itself; if none
    exists the `.mp4` path is returned so that the missing file is reported later with a sensible name.
    """
    if _cache is not None and name in _cache:
        return _cache[name]
    base = Path(name).expanduser()
    if not base.is_absolute() and video_dir is not None:
        base = Path(video_dir).expanduser() / base
    if base.suffix.lower() in _KNOWN_SUFFIXES:
        found = base
    else:
        candidates = [base.with_name(base.name + ext) for ext in VIDEO_EXTENSIONS] + [base]
        found = next((c for c in candidates if c.is_file()), candidates[0])
    out = str(found)
    if _cache is not None:
        _cache[name] = out
    return out


def span_problem(span: tuple[float, float], duration: float | None, tolerance: float = 0.5) -> tuple[str, str] | None:
    """Why `span` is unusable, as (kind, message), or None when it is fine.

    kind is one of "bad_number", "start_ge_end", "outside_duration". An end past the duration by at most `tolerance`
    seconds is accepted (annotations are often rounded up; `clamp_span` fixes it).
    """
    s, e = span
    if not (math.isfinite(s) and math.isfinite(e)):
        return "bad_number", f"span {s}-{e} is not a pair of finite numbers"
    if s >= e:
        return "start_ge_end", f"start {s:g} >= end {e:g}"
    if s < 0:
        return "outside_duration", f"span {s:g}-{e:g} s starts before 0"
    if duration is not None and (e > duration + tolerance or s >= duration):
        return "outside_duration", f"span {s:g}-{e:g} s is not inside the video (duration {duration:g} s)"
    return None


def clamp_span(span: tuple[float, float], duration: float | None) -> tuple[float, float]:
    """Clip an accepted span to [0, duration] (only tolerance-sized changes once `span_problem` passed)."""
    s, e = max(0.0, span[0]), span[1]
    if duration is not None:
        e = min(e, duration)
    return (s, e)
