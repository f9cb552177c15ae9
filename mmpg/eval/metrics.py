"""Grounding metrics (pure): recall at IoU thresholds and mean IoU over a set of predictions.

    R1@m = share of samples whose top-1 predicted span has tIoU with the truth above m
    mIoU = mean tIoU, an unparseable answer counting 0

Published evaluations disagree on "above": Time-R1's code counts tIoU > m, VideoChat-R1's tIoU >= m. Both are
reported (`r1@0.5` with `>`, `r1@0.5_ge` with `>=`); they differ only for predictions whose tIoU equals m exactly,
which happens on benchmarks with whole-second spans. tIoU is compared as computed (no rounding), as both papers' code
does.

How an answer becomes a span and a tIoU is the `scoring` setting, part of each protocol:

  mmpg       (protocol default) `mmpg.rewards.parse_answer`, the rule training rewards use: the span inside the last
             <answer> tags, clamped to [0, duration]; an answer with no span, a reversed span (unless swap_reversed),
             an empty span or a span wholly outside the video is unparseable and scores 0; the ground truth is the
             loaded span (an end just past the duration clamped, `mmpg.data.samples`).
  last_span  (time_r1, videochat_r1, tvgbench) the papers' evaluation code: the last "A to B" or "A and B" (numbers
             written with digits and an optional decimal part) anywhere in the answer, tags or not (Time-R1
             `evaluate.py` extract_answer, VideoChat-R1 `src_eval/evaluate_tg_c8.py` parse_timestamp_output); tIoU
             of the raw spans, nothing clamped, answer nor ground truth (`raw_span`): max(0, min(e, e') - max(s, s'))
             / (max(e, e') - min(s, s')) (Time-R1 `src/vllm_inference/eval_all.py` compute_IoU; VideoChat-R1 the same
             floored at 0), so a reversed answer scores 0 through the formula itself, and an answer past the end of the
             video widens the union. A sample whose video could not be used ("failed") scores 0 and counts in the
denominator when bad_videos="fail", and is left out of it when bad_videos="skip"; either way it is counted apart
from the unparseable answers.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Sequence

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


SCORINGS = ("mmpg", "last_span")
_LAST_SPAN = re.compile(r"(\d+\.?\d*) (?:to|and) (\d+\.?\d*)")


def last_span(text: str) -> tuple[float, float] | None:
    """The papers' parser (scoring "last_span"): the last "A to B" / "A and B" anywhere in `text`, as written."""
    matches = _LAST_SPAN.findall(text or "")
    return (float(matches[-1][0]), float(matches[-1][1])) if matches else None


def raw_iou(pred: tuple[float, float], truth: tuple[float, float]) -> float:
    """tIoU of two spans as written (scoring "last_span"): max(0, intersection) / union, union over the outer ends.
    A reversed `pred` has a negative intersection, so 0; nothing is clamped to the video."""
    inter = min(pred[1], truth[1]) - max(pred[0], truth[0])
    union = max(pred[1], truth[1]) - min(pred[0], truth[0])
    return max(0.0, inter) / union if union > 0 else 0.0


def score_sample(text: str, sample, scoring: str = "mmpg", swap_reversed: bool = False) -> tuple[Scored, tuple]:
    """(Scored, the ground truth it was scored against) for one answer to `sample` under `scoring` (docstring)."""
    truth = scored_truth(sample, scoring)
    if scoring == "mmpg":
        return score_answer(text, truth, sample.duration, swap_reversed), truth
    return score_raw(text, truth), truth


def scored_truth(sample, scoring: str = "mmpg") -> tuple[float, float]:
    """The ground truth `scoring` compares with: the loaded span (mmpg) or the file's own (last_span)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    raw = getattr(sample, "raw_span", None) if scoring == "last_span" else None
    return tuple(raw or sample.span)


def score_raw(text: str, truth: tuple[float, float]) -> Scored:
    """scoring "last_span": the last span anywhere in `text` against `truth`, both as written."""
    span = last_span(text)
    if span is None:
        return Scored(None, 0.0, "no 'A to B' or 'A and B' with numbers in the answer")
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
