"""Trivial grounding baselines: what a benchmark's numbers are worth before any model looks at a video.

    whole video:      answer [0, d] for every query (d: the video's duration)
    mean train span:  answer [s̄·d, ē·d], where s̄ and ē are the training spans' mean start and end as fractions of
                      their videos' durations

Both ignore the video and the sentence, so a model that beats them has learnt something from its input; they are
the rows to set beside a model in a results table. Scored with `grounding_metrics`, like the model's answers.
"""

from __future__ import annotations

from typing import Sequence

from mmpg.data.samples import GroundingSample
from mmpg.eval.metrics import grounding_metrics

Span = tuple[float, float]


def _duration(sample: GroundingSample) -> float:
    if sample.duration is None or not sample.duration > 0:
        raise ValueError(f"{sample.where}: a trivial baseline needs the video's duration, got {sample.duration!r}")
    return float(sample.duration)


def mean_relative_span(train: Sequence[GroundingSample]) -> Span:
    """(s̄, ē): mean start and end of the training spans as fractions of their videos' durations."""
    if not train:
        raise ValueError("the mean-span baseline needs at least one training sample")
    starts = [s.span[0] / _duration(s) for s in train]
    ends = [s.span[1] / _duration(s) for s in train]
    return sum(starts) / len(starts), sum(ends) / len(ends)


def whole_video_spans(test: Sequence[GroundingSample]) -> list[Span]:
    return [(0.0, _duration(s)) for s in test]


def mean_span_spans(test: Sequence[GroundingSample], relative: Span) -> list[Span]:
    return [(relative[0] * _duration(s), relative[1] * _duration(s)) for s in test]


def trivial_baselines(train: Sequence[GroundingSample], test: Sequence[GroundingSample]) -> dict[str, dict]:
    """{"whole video": metrics, "mean train span": metrics} on `test`, metrics as `grounding_metrics` returns."""
    truths = [tuple(s.span) for s in test]
    return {
        "whole video": grounding_metrics(whole_video_spans(test), truths),
        "mean train span": grounding_metrics(mean_span_spans(test, mean_relative_span(train)), truths),
    }
