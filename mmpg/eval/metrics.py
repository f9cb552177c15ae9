"""Grounding metrics (pure): recall at IoU thresholds and mean IoU over a set of predictions.

    R1@m = share of samples whose top-1 predicted span has tIoU with the truth above m
    mIoU = mean tIoU, an unparseable answer counting 0

Published evaluations disagree on "above": Time-R1's code counts tIoU > m, VideoChat-R1's tIoU >= m. Both are
reported (`r1@0.5` with `>`, `r1@0.5_ge` with `>=`); they differ only for predictions whose tIoU equals m exactly,
which happens on benchmarks with whole-second spans.
"""

from __future__ import annotations

from mmpg.rewards import temporal_iou

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
