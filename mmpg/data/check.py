"""`mmpg check-data`: find what would make samples fail before a run starts.

Reports, per kind: malformed records, missing videos, unreadable videos (empty, cannot open, first/middle/last frame
does not decode), spans with start >= end, spans outside the video (or outside their clip window), annotation
durations that disagree with the file, and duplicate sample ids. It says how many queries training and evaluation will
use (those without a skip-causing problem, SKIPS) and why the others are left out. Spans that end a little past the
duration are kept and clamped (the rule: `mmpg.data.samples`); they are listed as notes, which do not change the exit
status.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmpg.data.formats import detect_format, load_annotations
from mmpg.data.samples import ROUNDING_S, GroundingSample, fit_span, span_problem
from mmpg.data.video import VideoError, verify_video
from mmpg.errors import UserError

KINDS = {  # kind -> title, in report order
    "malformed": "malformed records",
    "missing_video": "missing videos",
    "unreadable_video": "unreadable videos",
    "bad_number": "spans that are not numbers",
    "start_ge_end": "spans with start >= end",
    "outside_duration": "spans outside the video",
    "outside_clip": "spans outside their clip window",
    "duration_mismatch": "durations that disagree with the video file",
    "duplicate_id": "duplicate sample ids",
}
# The kinds that make training and evaluation leave a query out (the loader, fill_durations or the dataset skip it).
SKIPS = ("malformed", "missing_video", "unreadable_video", "bad_number", "start_ge_end", "outside_duration")
NOTES = {"clamped": "ends past the duration (kept, clamped for training)"}  # kind -> title; not problems
MAX_LISTED = 20  # problems (and notes) listed per kind in the text report
# A stated duration may differ from the video file's by max(1 s, 5 % of the file's) before it is reported: containers
# round their durations, and re-encoded copies gain or lose a frame or two.
DURATION_GAP_S, DURATION_GAP_FRACTION = 1.0, 0.05


@dataclasses.dataclass
class Problem:
    kind: str  # a key of KINDS
    where: str  # file:line / file[key] / sample
    message: str


@dataclasses.dataclass
class Note:
    kind: str  # a key of NOTES
    where: str
    message: str
    seconds: float  # how far the end lies past the duration


@dataclasses.dataclass
class Report:
    annotations: str
    video_dir: str | None
    fmt: str
    n_samples: int  # records that parsed into a sample
    n_videos: int
    problems: list[Problem]
    notes: list[Note] = dataclasses.field(default_factory=list)
    n_records: int = 0  # queries in the file: n_samples + malformed records
    skipped: Counter = dataclasses.field(default_factory=Counter)  # kind (of SKIPS) -> queries left out, one each

    @property
    def ok(self) -> bool:
        """No problems; notes alone keep a report OK."""
        return not self.problems

    @property
    def n_used(self) -> int:
        """Queries training and evaluation will use."""
        return self.n_records - sum(self.skipped.values())

    def counts(self) -> Counter:
        return Counter(p.kind for p in self.problems)


def _probe_all(paths: list[str], workers: int) -> dict[str, float | VideoError]:
    def probe(path: str) -> float | VideoError:
        try:
            return verify_video(path)
        except VideoError as e:
            return e

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return dict(zip(paths, pool.map(probe, paths)))


def _sample_problems(sample: GroundingSample, video_duration: float | None) -> tuple[list[Problem], Note | None]:
    out = []
    duration = sample.duration if sample.duration is not None else video_duration
    problem = span_problem(sample.span, duration)
    note = None
    if problem is not None:
        out.append(Problem(problem[0], sample.where, problem[1]))
    span, raw = fit_span(sample.span, duration) if problem is None else (sample.span, None)
    if raw is not None:
        over = raw[1] - duration
        note = Note("clamped", sample.where, f"span {raw[0]:g}-{raw[1]:g} s ends {round(over, 3):g} s after the "
                    f"duration ({duration:g} s); trained on {span[0]:g}-{span[1]:g} s", over)
    if sample.duration is not None and video_duration is not None:
        gap = abs(sample.duration - video_duration)
        if gap > max(DURATION_GAP_S, DURATION_GAP_FRACTION * video_duration):
            out.append(Problem("duration_mismatch", sample.where, f"annotation says {sample.duration:g} s, "
                               f"{sample.video} lasts {video_duration:.2f} s"))
    lo = sample.clip_start if sample.clip_start is not None else 0.0
    hi = sample.clip_end if sample.clip_end is not None else duration
    if (sample.clip_start is not None or sample.clip_end is not None) and problem is None:
        # a clip window is the user's choice, not a rounded annotation: only float rounding is allowed
        if hi is not None and not (lo - ROUNDING_S <= span[0] and span[1] <= hi + ROUNDING_S):
            out.append(Problem("outside_clip", sample.where,
                               f"span {span[0]:g}-{span[1]:g} s is not inside clip {lo:g}-{hi:g} s"))
    return out, note


def check_dataset(annotations: str | Path, video_dir: str | Path | None, fmt: str = "auto", *,
                  workers: int | None = None) -> Report:
    """Load `annotations` without skipping anything silently, open every video, and collect the problems."""
    if video_dir is not None and not Path(video_dir).is_dir():
        raise UserError(f"video folder {video_dir} not found; pass --videos with the folder holding the videos")
    if fmt == "auto":
        fmt = detect_format(annotations)
    loaded = load_annotations(annotations, video_dir, fmt, strict=False, validate=False, log_skips=False)
    problems = [Problem("malformed", s.where, s.reason) for s in loaded.skipped]
    skipped = Counter(malformed=len(loaded.skipped)) if loaded.skipped else Counter()
    notes: list[Note] = []

    by_video: dict[str, list[GroundingSample]] = defaultdict(list)
    for sample in loaded.samples:
        by_video[sample.video].append(sample)
    probed = _probe_all(list(by_video), workers or min(4, os.cpu_count() or 1))
    for path, samples in by_video.items():
        result = probed[path]
        video_kind = None
        if isinstance(result, VideoError):
            video_kind = "missing_video" if not os.path.exists(path) else "unreadable_video"
            used = f" (used by {len(samples)} samples)" if len(samples) > 1 else ""
            problems.append(Problem(video_kind, samples[0].where, f"{result}{used}"))
        for sample in samples:
            found, note = _sample_problems(sample, None if video_kind else result)
            problems.extend(found)
            why = video_kind or next((p.kind for p in found if p.kind in SKIPS), None)
            if why:
                skipped[why] += 1  # once per query, for its first reason
            elif note is not None:
                notes.append(note)

    origins: dict[str, list[str]] = defaultdict(list)
    for sample in loaded.samples:
        origins[sample.sample_id].append(sample.origin)
    for sample_id, where in origins.items():
        if len(where) > 1:
            problems.append(Problem("duplicate_id", where[0], f"id {sample_id!r} is used {len(where)} times: "
                                    + ", ".join(where[:5]) + (" ..." if len(where) > 5 else "")))
    return Report(annotations=str(annotations), video_dir=None if video_dir is None else str(video_dir), fmt=fmt,
                  n_samples=len(loaded.samples), n_videos=len(by_video), problems=problems, notes=notes,
                  n_records=len(loaded.samples) + len(loaded.skipped), skipped=skipped)


def format_report(report: Report) -> str:
    """A text report, grouped by kind, at most MAX_LISTED problems listed per kind."""
    lines = [f"annotations: {report.annotations} (format {report.fmt})",
             f"videos:      {report.video_dir}",
             f"{report.n_samples} samples, {report.n_videos} videos",
             f"queries: {report.n_records} in the file, {report.n_used} will be used (trained on / evaluated), "
             f"{sum(report.skipped.values())} skipped"
             + "".join(f"\n  skipped, {KINDS[k]}: {report.skipped[k]}" for k in SKIPS if report.skipped[k])]
    for kind, title in NOTES.items():
        listed = [n for n in report.notes if n.kind == kind]
        if listed:
            lines.append(f"note: {title}: {len(listed)}, max {round(max(n.seconds for n in listed), 3):g} s")
            lines += [f"  {n.where}: {n.message}" for n in listed[:MAX_LISTED]]
            if len(listed) > MAX_LISTED:
                lines.append(f"  ... and {len(listed) - MAX_LISTED} more")
    counts = report.counts()
    for kind, title in KINDS.items():
        if not counts[kind]:
            continue
        lines.append(f"{title}: {counts[kind]}")
        listed = [p for p in report.problems if p.kind == kind]
        lines += [f"  {p.where}: {p.message}" for p in listed[:MAX_LISTED]]
        if len(listed) > MAX_LISTED:
            lines.append(f"  ... and {len(listed) - MAX_LISTED} more")
    if report.ok:
        lines.append("OK: no problems found" + (f" ({len(report.notes)} notes)" if report.notes else ""))
    else:
        lines.append(f"{len(report.problems)} problems found: fix them, or train with strict off to skip the "
                     "affected samples (each skip is counted and logged)")
    return "\n".join(lines)


def run_check(annotations: str | Path, video_dir: str | Path | None, fmt: str = "auto") -> int:
    """Print the report of `check_dataset`; return the exit status (0 clean or notes only, 1 problems found)."""
    report = check_dataset(annotations, video_dir, fmt)
    print(format_report(report))
    return 0 if report.ok else 1
