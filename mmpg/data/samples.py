"""The one sample type every annotation format becomes, and how its video file is found.

Times are seconds from the start of the *whole* video file. An optional clip window (`clip_start`, `clip_end`)
restricts which frames the model is shown; the span and the expected answer stay in whole-video seconds, and the
prompt states the window.

Ends past the duration. Public annotations often end a little after the duration they state: Charades-STA test has
562 of 3,720 queries ending up to 1.5 s past it, TimeRFT 18 ending 0.02-16.4 s past it and 14 more by float rounding
(1e-14 s). The papers evaluate all of these, so a span whose end is past the duration by at most
`end_margin(duration)` = max(END_MARGIN_S, END_MARGIN_FRACTION * duration) is kept: `span` holds it clamped to the
duration (training targets, rewards, mmpg's default evaluation), `raw_span` the file's span (what the papers'
protocols score). Farther out the annotation is wrong (TimeRFT: an end at 14,220 s in a 158 s video); such a span, a
start >= end, a start at or past the duration, or a start before 0 is skipped and counted (strict: raises).
Differences up to ROUNDING_S are float rounding: clamped, not recorded in `raw_span`, not counted as clamped.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, NamedTuple

# Tried in this order when an annotation names a video without an extension (Charades ids, ActivityNet ids).
VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov")
# Suffixes that mean "this name already carries its extension" (the list above plus a few more containers).
_KNOWN_SUFFIXES = frozenset(VIDEO_EXTENSIONS + (".m4v", ".mpg", ".mpeg", ".flv", ".wmv", ".3gp", ".ts"))

# How far past the stated duration an annotated end may lie and still be kept (clamped): the larger of 2 s and 10 %
# of the duration. Seen in the public files: Charades-STA ends up to 1.5 s past ~30 s videos (2 s covers them with
# room); TimeRFT ends up to 2.7 s past ~27.5 s videos, 11.2 s past a 144 s and 16.4 s past a 205 s one (10 % covers
# them). Beyond: 2.78 s past 22.2 s TimeRFT videos (four of them), 4.85 s past a 27.9 s TVGBench clip, and ends
# hundreds to 14,062 s past (TimeRFT), which are annotation errors.
END_MARGIN_S, END_MARGIN_FRACTION = 2.0, 0.10
# Below this, a difference between a span and the duration is float rounding (TimeRFT ends 1e-14 s past it).
ROUNDING_S = 1e-6


def end_margin(duration: float) -> float:
    """Seconds an end may lie past `duration` and still be kept, clamped: max(2 s, 10 % of the duration)."""
    return max(END_MARGIN_S, END_MARGIN_FRACTION * duration)


@dataclasses.dataclass(frozen=True)
class GroundingSample:
    """One (video, sentence, moment) triple.

    sample_id: unique within a dataset, e.g. `3MSZA#0` or `v_QOlSCBRmfWY#2` (video id, `#`, sentence index).
    video: path of the video file (resolved against the video folder; it may not exist, which `check-data` reports).
    duration: seconds of the whole video, or None until read from the file (`fill_durations`, or the dataset).
    query: the sentence describing the moment.
    span: (start, end) of the moment in seconds, start < end, clamped to [0, duration] (see the module docstring):
        what training targets, rewards and mmpg's default evaluation use (as the file has it when `as_written`
        and the span is one the rule would skip).
    clip_start / clip_end: optional window of the video shown to the model (seconds); None = whole video.
    origin: where the sample came from, `file:line` or `file[index]`, for error messages.
    raw_span: the file's (start, end) when clamping changed it by more than ROUNDING_S (an end up to
        `end_margin(duration)` past the duration), else None; a paper's protocol scores `raw_span or span`.
    metadata: the record's other fields as (key, value) pairs, lists and objects made tuples so the sample stays
        hashable (TVGBench's `question_type`, `dataset_name`, `qsemtype`, `bins`, ...); `meta` gives a dict.
    as_written: loaded for a paper's scoring (`load_annotations(keep_all=True)`), which scores every record with
        a readable span. A span `span_problem` rejects (zero-length, reversed, a start outside the video, an end
        more than `end_margin` past it) is then kept, not skipped: `span` is the file's span, `raw_span` None, and
        nothing may train on it (`span_problem(span, duration)` says why). Sound spans are clamped as usual.
    raw_query: the file's text of the query when the loader changed it (whitespace at the ends stripped, or
        squashed), else None; a protocol that puts the query into its prompt as written uses it
        (`mmpg.data.queries`).
    """

    sample_id: str
    video: str
    duration: float | None
    query: str
    span: tuple[float, float]
    clip_start: float | None = None
    clip_end: float | None = None
    origin: str = ""
    raw_span: tuple[float, float] | None = None
    metadata: tuple[tuple[str, Any], ...] = ()
    as_written: bool = False
    raw_query: str | None = None

    @property
    def meta(self) -> dict[str, Any]:
        """`metadata` as a dict (nested objects stay tuples of pairs)."""
        return dict(self.metadata)

    @property
    def where(self) -> str:
        """`origin (sample id)` — what an error message names."""
        return f"{self.origin} (sample {self.sample_id})" if self.origin else f"sample {self.sample_id}"


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


def span_problem(span: tuple[float, float], duration: float | None) -> tuple[str, str] | None:
    """Why `span` is unusable, as (kind, message), or None when it is fine (`fit_span` then clamps it).

    kind is one of "bad_number", "start_ge_end", "outside_duration" (a start before 0 or at/past the duration, an
    end more than `end_margin(duration)` past it). An end past the duration by less is accepted.
    """
    s, e = span
    if not (math.isfinite(s) and math.isfinite(e)):
        return "bad_number", f"span {s}-{e} is not a pair of finite numbers"
    if s >= e:
        return "start_ge_end", f"start {s:g} >= end {e:g}"
    if s < -ROUNDING_S:
        return "outside_duration", f"span {s:g}-{e:g} s starts before 0"
    if duration is None:
        return None
    outside = f"span {s:g}-{e:g} s is not inside the video (duration {duration:g} s"
    if s >= duration:
        return "outside_duration", f"{outside}, start at or past its end)"
    margin = end_margin(duration)
    if e > duration + margin:
        return "outside_duration", (f"{outside}, end {round(e - duration, 2):g} s past it, more than the "
                                    f"{round(margin, 2):g} s allowed: max({END_MARGIN_S:g} s, "
                                    f"{END_MARGIN_FRACTION:.0%} of the duration))")
    return None


def clamp_span(span: tuple[float, float], duration: float | None) -> tuple[float, float]:
    """Clip an accepted span to [0, duration] (`span_problem` bounds the change: rounding at the start, at most
    `end_margin(duration)` at the end)."""
    s, e = max(0.0, span[0]), span[1]
    if duration is not None:
        e = min(e, duration)
    return (s, e)


def fit_span(span: tuple[float, float], duration: float | None) -> tuple[tuple[float, float],
                                                                         tuple[float, float] | None]:
    """(span clamped to [0, duration], the file's span if clamping moved an end by more than ROUNDING_S else None)
    for a span `span_problem` accepted: the `span` and `raw_span` of a GroundingSample."""
    clamped = clamp_span(span, duration)
    moved = max(abs(clamped[0] - span[0]), abs(clamped[1] - span[1]))
    return clamped, (float(span[0]), float(span[1])) if moved > ROUNDING_S else None


def frozen(value: Any) -> Any:
    """A JSON value made hashable: lists become tuples, objects tuples of (key, value) pairs, recursively."""
    if isinstance(value, dict):
        return tuple((str(k), frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value
