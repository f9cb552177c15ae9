"""`mmpg check-data`: find what would make samples fail before a run starts.

Reports, per kind: malformed records, missing videos, unreadable videos (empty, cannot open, first/middle/last frame
does not decode), spans with start >= end, spans outside the video (or outside their clip window), annotation
durations that disagree with the file, and duplicate sample ids.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmpg.data.formats import detect_format, load_annotations
from mmpg.data.samples import GroundingSample, span_problem
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
MAX_LISTED = 20  # problems listed per kind in the text report


@dataclasses.dataclass
class Problem:
    kind: str  # a key of KINDS
    where: str  # file:line / file[key] / sample
    message: str


@dataclasses.dataclass
class Report:
    annotations: str
    video_dir: str | None
    fmt: str
    n_samples: int
    n_videos: int
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems

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


def _sample_problems(sample: GroundingSample, video_duration: float | None, tolerance: float) -> list[Problem]:
    out = []
    duration = sample.duration if sample.duration is not None else video_duration
    problem = span_problem(sample.span, duration, tolerance)
    if problem is not None:
        out.append(Problem(problem[0], sample.where, problem[1]))
    if sample.duration is not None and video_duration is not None:
        gap = abs(sample.duration - video_duration)
        if gap > max(1.0, 0.05 * video_duration):
            out.append(Problem("duration_mismatch", sample.where, f"annotation says {sample.duration:g} s, "
                               f"{sample.video} lasts {video_duration:.2f} s"))
    lo = sample.clip_start if sample.clip_start is not None else 0.0
    hi = sample.clip_end if sample.clip_end is not None else duration
    if (sample.clip_start is not None or sample.clip_end is not None) and problem is None:
        if hi is not None and not (lo - tolerance <= sample.span[0] and sample.span[1] <= hi + tolerance):
            out.append(Problem("outside_clip", sample.where,
                               f"span {sample.span[0]:g}-{sample.span[1]:g} s is not inside clip {lo:g}-{hi:g} s"))
    return out


def check_dataset(annotations: str | Path, video_dir: str | Path | None, fmt: str = "auto", *,
                  tolerance: float = 0.5, workers: int | None = None) -> Report:
    """Load `annotations` without skipping anything silently, open every video, and collect the problems."""
    if video_dir is not None and not Path(video_dir).is_dir():
        raise UserError(f"video folder {video_dir} not found; pass --videos with the folder holding the videos")
    if fmt == "auto":
        fmt = detect_format(annotations)
    loaded = load_annotations(annotations, video_dir, fmt, strict=False, validate=False, log_skips=False)
    problems = [Problem("malformed", s.where, s.reason) for s in loaded.skipped]

    by_video: dict[str, list[GroundingSample]] = defaultdict(list)
    for sample in loaded.samples:
        by_video[sample.video].append(sample)
    probed = _probe_all(list(by_video), workers or min(4, os.cpu_count() or 1))
    for path, samples in by_video.items():
        result = probed[path]
        if isinstance(result, VideoError):
            kind = "missing_video" if not os.path.exists(path) else "unreadable_video"
            used = f" (used by {len(samples)} samples)" if len(samples) > 1 else ""
            problems.append(Problem(kind, samples[0].where, f"{result}{used}"))
        for sample in samples:
            problems.extend(_sample_problems(sample, None if isinstance(result, VideoError) else result, tolerance))

    origins: dict[str, list[str]] = defaultdict(list)
    for sample in loaded.samples:
        origins[sample.sample_id].append(sample.origin)
    for sample_id, where in origins.items():
        if len(where) > 1:
            problems.append(Problem("duplicate_id", where[0], f"id {sample_id!r} is used {len(where)} times: "
                                    + ", ".join(where[:5]) + (" ..." if len(where) > 5 else "")))
    return Report(annotations=str(annotations), video_dir=None if video_dir is None else str(video_dir), fmt=fmt,
                  n_samples=len(loaded.samples), n_videos=len(by_video), problems=problems)


def format_report(report: Report) -> str:
    """A text report, grouped by kind, at most MAX_LISTED problems listed per kind."""
    lines = [f"annotations: {report.annotations} (format {report.fmt})",
             f"videos:      {report.video_dir}",
             f"{report.n_samples} samples, {report.n_videos} videos"]
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
        lines.append("OK: no problems found")
    else:
        lines.append(f"{len(report.problems)} problems found: fix them, or train with strict off to skip the "
                     "affected samples (each skip is counted and logged)")
    return "\n".join(lines)


def run_check(annotations: str | Path, video_dir: str | Path | None, fmt: str = "auto") -> int:
    """Print the report of `check_dataset`; return the exit status (0 clean, 1 problems found)."""
    report = check_dataset(annotations, video_dir, fmt)
    print(format_report(report))
    return 0 if report.ok else 1
