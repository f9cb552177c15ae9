"""Grounding metrics (pure): recall at IoU thresholds and mean IoU over a set of predictions.

    R1@m = share of samples whose top-1 predicted span has tIoU with the truth above m
    mIoU = mean tIoU, an unparseable answer counting 0

"Above" is reported both ways, as the papers' code disagrees: `r1@0.5` counts tIoU > m (Time-R1), `r1@0.5_ge`
tIoU >= m (VideoChat-R1); tIoU is compared as computed, unrounded. How an answer becomes a span and a tIoU is the
protocol's `scoring`: `mmpg` (`mmpg.rewards.parse_answer`, the rule training rewards use: clamped to [0, duration],
against the loaded span), `last_span` (Time-R1's and VideoChat-R1's evaluation code: the last "A to B" / "A and B"
anywhere, raw spans unclamped) or `timelens` (TimeLens's: the first time pair, rounded to whole seconds, raw spans).
Each reproduces the cited code; docs/evaluation.md ("Scoring") names it file by file, with its degenerate cases.
Contract: every tIoU is in [0, 1] and an unparseable answer scores 0; where the papers' code divides by zero (an
empty union) the tIoU is 0 and the answer is counted (`empty_union`). A failed sample (its video unusable) scores 0
in the denominator under bad_videos="fail", is left out under "skip", and is counted apart from the unparseable.
`duplicates`: "count" scores every record (Time-R1, VideoChat-R1), "once" one per (video, query, span) key, the
last one (TimeLens, `once_per_key`); the report gives the other denominator's figures beside when they differ.
"""

from __future__ import annotations

import math
import re
from pathlib import PurePath
from typing import NamedTuple, Sequence

from mmpg.data.queries import clean_query
from mmpg.rewards import parse_answer, temporal_iou

THRESHOLDS = (0.3, 0.5, 0.7)


def grounding_metrics(preds: list[tuple[float, float] | None], truths: list[tuple[float, float]],
                      thresholds=THRESHOLDS) -> dict[str, float]:
    """preds: one span or None (unparseable) per sample; truths: the ground-truth spans. Values in [0, 1]."""
    if len(preds) != len(truths):
        raise ValueError(f"{len(preds)} predictions for {len(truths)} ground-truth spans")
    n = len(truths)
    if n == 0:
        return {"count": 0.0}
    ious = [temporal_iou(tuple(p), tuple(t)) if p is not None else 0.0 for p, t in zip(preds, truths)]
    out = {"count": float(n), "miou": sum(ious) / n,
           "unparseable": sum(p is None for p in preds) / n}
    for m in thresholds:
        out[f"r1@{m}"] = sum(iou > m for iou in ious) / n
        out[f"r1@{m}_ge"] = sum(iou >= m for iou in ious) / n
    return out


class Scored(NamedTuple):
    """One answer scored against the truth: the parsed span (None when unparseable), its tIoU, why not parsed."""

    span: tuple[float, float] | None
    iou: float
    reason: str | None


def score_answer(text: str, truth: tuple[float, float], duration: float | None,
                 swap_reversed: bool = False) -> Scored:
    """Parse `text` as `parse_answer` does and score it against `truth` (IoU 0 when unparseable)."""
    parsed = parse_answer(text, duration, swap_reversed=swap_reversed)
    if not parsed.ok:
        return Scored(None, 0.0, parsed.reason)
    return Scored(parsed.span, temporal_iou(parsed.span, tuple(truth)), None)


SCORINGS = ("mmpg", "last_span", "timelens")
_LAST_SPAN = re.compile(r"(\d+\.?\d*) (?:to|and) (\d+\.?\d*)")


def last_span(text: str) -> tuple[float, float] | None:
    """The papers' parser (scoring "last_span"): the last "A to B" / "A and B" anywhere in `text`, as written."""
    matches = _LAST_SPAN.findall(text or "")
    return (float(matches[-1][0]), float(matches[-1][1])) if matches else None


def raw_iou(pred: tuple[float, float], truth: tuple[float, float]) -> float:
    """tIoU of two spans as written (scorings "last_span", "timelens"): max(0, intersection) / union, union over the
    outer ends. A reversed `pred` has a negative intersection, so 0; nothing is clamped to the video. A zero-length
    `truth` gives 0 to any `pred` of positive length; an empty union (`empty_union`) gives 0 where the papers' code
    divides by zero (docs/evaluation.md, "Scoring")."""
    inter = min(pred[1], truth[1]) - max(pred[0], truth[0])
    union = max(pred[1], truth[1]) - min(pred[0], truth[0])
    return max(0.0, inter) / union if union > 0 else 0.0


def empty_union(pred: tuple[float, float], truth: tuple[float, float]) -> bool:
    """Whether `raw_iou`'s union is <= 0: where the papers' code divides by zero (docs/evaluation.md, "Scoring")."""
    return max(pred[1], truth[1]) - min(pred[0], truth[0]) <= 0


def score_sample(text: str, sample, scoring: str = "mmpg", swap_reversed: bool = False) -> tuple[Scored, tuple]:
    """(Scored, the ground truth it was scored against) for one answer to `sample` under `scoring`."""
    truth = scored_truth(sample, scoring)
    return score_text(text, truth, sample.duration, scoring, swap_reversed), truth


def score_text(text: str, truth: tuple[float, float], duration: float | None, scoring: str = "mmpg",
               swap_reversed: bool = False) -> Scored:
    """One answer against `truth` (already `scored_truth`) under `scoring`."""
    if scoring == "mmpg":
        return score_answer(text, truth, duration, swap_reversed)
    if scoring == "timelens":
        return score_timelens(text, truth)
    return score_raw(text, truth)


def scored_truth(sample, scoring: str = "mmpg") -> tuple[float, float]:
    """The ground truth `scoring` compares with: the loaded span (mmpg) or the file's own (the papers')."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    raw = getattr(sample, "raw_span", None) if scoring != "mmpg" else None
    return tuple(raw or sample.span)


def score_raw(text: str, truth: tuple[float, float]) -> Scored:
    """scoring "last_span": the last span anywhere in `text` against `truth`, both as written."""
    span = last_span(text)
    if span is None:
        return Scored(None, 0.0, "no 'A to B' or 'A and B' with numbers in the answer")
    return Scored(span, raw_iou(span, tuple(truth)), None)


# TimeLens's answer patterns, tried in this order (`extract_time`); the first pair found is scored.
_CLOCK = re.compile(r"\b(\d{1,2}:\d{2}:\d{2}(?:\.\d+)?|\d{1,2}:\d{2}(?:\.\d+)?)\b")  # 01:02:03.5, 1:05
_PAIRS = (re.compile(r"(\d+\.?\d*)\s*-\s*(\d+\.?\d*)"), re.compile(r"(\d+\.?\d*)\s+to\s+(\d+\.?\d*)"))
_BARE = re.compile(r"\b(\d+\.\d+|\d+)\b")


def _clock(t: str) -> float:
    """'h:mm:ss(.f)' or 'm:ss(.f)' in seconds."""
    parts = t.split(":")
    return sum(float(x) * 60 ** k for k, x in enumerate(reversed(parts)))


def timelens_span(text: str) -> tuple[float, float] | None:
    """TimeLens's parser (scoring "timelens"): the first clock-time pair, else the first "A - B", else the first
    "A to B", else the first two numbers, in the lower-cased answer; each end rounded to whole seconds (halves to
    even, as Python's round). None when no pair is found."""
    text = (text or "").lower()
    clocks = _CLOCK.findall(text)
    if len(clocks) >= 2:
        pair = (_clock(clocks[0]), _clock(clocks[1]))
    else:
        found = next((m for m in (p.search(text) for p in _PAIRS) if m), None)
        numbers = _BARE.findall(text)
        if found is None and len(numbers) < 2:
            return None
        pair = (float(found[1]), float(found[2])) if found else (float(numbers[0]), float(numbers[1]))
    return float(round(pair[0])), float(round(pair[1]))


def score_timelens(text: str, truth: tuple[float, float]) -> Scored:
    """scoring "timelens": TimeLens's first span, rounded to seconds, against `truth` as written (`raw_iou`)."""
    span = timelens_span(text)
    if span is None:
        return Scored(None, 0.0, "no time pair in the answer (TimeLens's extract_time finds none)")
    return Scored(span, raw_iou(span, tuple(truth)), None)


def recall(ious: Sequence[float], m: float, rule: str = "gt") -> float:
    """Share of `ious` above m: tIoU > m (rule "gt") or tIoU >= m ("ge"); NaN for no samples."""
    if rule not in ("gt", "ge"):
        raise ValueError(f"rule must be 'gt' or 'ge', got {rule!r}")
    if not ious:
        return math.nan
    return sum((iou > m) if rule == "gt" else (iou >= m) for iou in ious) / len(ious)


def recall_curve(ious: Sequence[float], rule: str = "gt", points: int = 101) -> tuple[list[float], list[float]]:
    """(thresholds 0..1, recall at each) for the recall-vs-threshold plot."""
    xs = [i / (points - 1) for i in range(points)]
    return xs, [recall(ious, x, rule) for x in xs]


def benchmark_metrics(ious: Sequence[float], unparseable: Sequence[bool], failed: Sequence[bool],
                      bad_videos: str = "fail", thresholds=THRESHOLDS) -> dict[str, float]:
    """Metrics of a whole benchmark from per-sample values (one entry per evaluated sample, in any order).

    ious: tIoU of each sample (0 for unparseable and failed ones); unparseable: the answer had no usable span;
    failed: the video could not be used. Returns fractions in [0, 1] (NaN when nothing is scored):
    count (samples in the denominators), total (samples evaluated), failed / failed_share, unparseable /
    unparseable_count (share and number of answered samples in the denominators without a span), miou,
    r1@m (tIoU > m) and r1@m_ge (tIoU >= m) for every m.
    """
    if not len(ious) == len(unparseable) == len(failed):
        raise ValueError(f"lengths differ: {len(ious)} ious, {len(unparseable)} unparseable, {len(failed)} failed")
    if bad_videos not in ("fail", "skip"):
        raise ValueError(f"bad_videos must be 'fail' or 'skip', got {bad_videos!r}")
    rows = [(iou, bad, fail) for iou, bad, fail in zip(ious, unparseable, failed)]
    scored = [(0.0 if fail else iou, bad and not fail) for iou, bad, fail in rows
              if bad_videos == "fail" or not fail]
    n, total = len(scored), len(rows)
    n_failed, n_unparseable = sum(failed), sum(b for _, b in scored)
    values = [iou for iou, _ in scored]
    out = {"count": float(n), "total": float(total), "failed": float(n_failed),
           "failed_share": n_failed / total if total else math.nan,
           "unparseable_count": float(n_unparseable), "unparseable": n_unparseable / n if n else math.nan,
           "miou": sum(values) / n if n else math.nan}
    for m in thresholds:
        out[f"r1@{m}"] = recall(values, m, "gt")
        out[f"r1@{m}_ge"] = recall(values, m, "ge")
    return out


DUPLICATES = ("count", "once")
_OTHER = {"count": "counted_once", "once": "every_record"}  # metrics.json prefix of the other denominator's figures


def once_per_key(records: Sequence) -> list:
    """The records TimeLens's compute_metrics.py counts (module docstring): of the records sharing a key (the video's
    file name, the query cleaned as TimeLens's `parse_query` cleans it, the ground-truth span), the last one; in
    the order of each key's first record. `records`: anything with .video, .query, .gt_span (PredictionRecord)."""
    kept: dict = {}
    for r in records:
        key = (PurePath(r.video).name, clean_query(r.query, "timelens"), tuple(float(x) for x in r.gt_span))
        kept[key] = r  # a dict update: a repeated key keeps its place and takes the later record
    return list(kept.values())


def denominator_metrics(records: Sequence, bad_videos: str = "fail", duplicates: str = "count") -> tuple[dict, list]:
    """(`benchmark_metrics` of the records `duplicates` counts, those records; under "once" its count and total are
    keys, not records). metrics also holds `duplicates`,
    `duplicate_records` (records repeating an earlier one's key) and, when that is > 0, the other denominator's
    count, miou and r1@m under `counted_once/` (duplicates="count") or `every_record/` ("once")."""
    if duplicates not in DUPLICATES:
        raise ValueError(f"duplicates must be one of {', '.join(DUPLICATES)}, got {duplicates!r}")
    unique = once_per_key(records)
    counted, other = (unique, list(records)) if duplicates == "once" else (list(records), unique)
    metrics = _record_metrics(counted, bad_videos)
    metrics.update(duplicates=duplicates, duplicate_records=float(len(records) - len(unique)))
    if len(unique) != len(records):
        alt = _record_metrics(other, bad_videos)
        metrics.update({f"{_OTHER[duplicates]}/{k}": v for k, v in alt.items()
                        if k in ("count", "miou") or k.startswith("r1@")})
    return metrics, counted


def _record_metrics(records: Sequence, bad_videos: str) -> dict:
    return benchmark_metrics([r.iou for r in records], [r.error is None and r.pred_span is None for r in records],
                             [r.error is not None for r in records], bad_videos)


def zoom_metrics(records: Sequence) -> dict:
    """The zoom protocol's figures (template=zoom: records holding their `turns`), over the answered samples: the
    mean zooms (tool turns that showed a clip), error turns and clip frames per sample, the share that zoomed at
    least once, and per zoom count k the samples that made k zooms and their mIoU (%: the keys' values are 0..1 as
    every metric). {} when no record has turns."""
    rows = [r for r in records if r.turns is not None and r.error is None]
    if not rows:
        return {}
    zooms = [sum("zoom" in t for t in r.turns) for r in rows]
    out = {"zoom/calls_mean": sum(zooms) / len(rows),
           "zoom/errors_mean": sum(sum("error" in t for t in r.turns) for r in rows) / len(rows),
           "zoom/clip_frames_mean": sum(sum(t.get("frames", 0) for t in r.turns) for r in rows) / len(rows),
           "zoom/used_share": sum(z > 0 for z in zooms) / len(rows)}
    for k in sorted(set(zooms)):
        ious = [r.iou for r, z in zip(rows, zooms) if z == k]
        out[f"zoom/count@{k}"] = len(ious)
        out[f"zoom/miou@{k}"] = sum(ious) / len(ious)
    return out
