"""What became of a response's answer, read again without the video's bounds: ok, truncated, unparsed, out of
range (a span wholly outside the video, rejected) or clamped (partly outside, cut to the video); and its tIoU.

The rewards score the span `parse_answer(text, duration)` returns, checked against [0, duration]; the inspector
parses the answer once more with no duration, so a rejected or clamped span can be shown as it was written.
"""

from __future__ import annotations

import dataclasses
import math

from mmpg_app.render import fmt
from mmpg.rewards.grounding import temporal_iou
from mmpg.rewards.parse import parse_answer
from mmpg.runs import ResponseRecord


@dataclasses.dataclass(frozen=True)
class AnswerFate:
    """What became of a response's answer. label: "ok", "truncated" (hit max_new_tokens), "unparsed" (no span
    read), "out of range" (a span wholly outside the video: rejected, though its format may still score) or
    "clamped" (a span partly outside, cut to the video). raw: the answer as written, where it matters."""

    label: str
    raw: str | None = None
    why: str = ""

    @property
    def failed(self) -> bool:
        return self.label != "ok"

    def text(self) -> str:
        """One short cell: 'ok', 'truncated', 'unparsed', 'out of range: 24 to 30', 'clamped from 16 to 24'."""
        if self.label == "out of range" and self.raw:
            return f"out of range: {self.raw}"
        if self.label == "clamped" and self.raw:
            return f"clamped from {self.raw}"
        return self.label


def response_fate(r: ResponseRecord, duration: float) -> AnswerFate:
    """The fate of one response of a rollout group."""
    return answer_fate(r.text, r.parsed_span, r.finish_reason, duration)


def answer_fate(text: str, span: list[float] | None, finish: str, duration: float) -> AnswerFate:
    """The fate of an answer `text` whose scored span is `span` (None: no span) in a video of `duration` s."""
    if finish == "length":
        return AnswerFate("truncated", why="hit max_new_tokens before the answer closed")
    raw = parse_answer(text, None)  # the span as written, before it is checked against [0, duration]
    short = raw.answer[:60] if raw.answer else None
    outside = raw.reason is not None and "outside the video" in raw.reason  # ends at or before 0
    known = math.isfinite(duration)
    if span is None:
        if outside or (raw.ok and known and raw.span[0] >= duration):
            return AnswerFate("out of range", short, f"{short!r} lies outside the {fmt(duration, 1)} s video")
        return AnswerFate("unparsed", short, raw.reason or "no span was read")
    if raw.ok and (raw.span[0] < 0 or (known and raw.span[1] > duration)):
        return AnswerFate("clamped", short, f"{short!r} was cut to the {fmt(duration, 1)} s video")
    return AnswerFate("ok")


def left_the_video(r: ResponseRecord, duration: float) -> bool:
    """Whether the answer was out of range or clamped. A clamped span ends at 0 or at the duration and a rejected one
    has no span, so any other response is answered without parsing it again (a long run has many)."""
    if r.finish_reason == "length":
        return False
    if r.parsed_span is not None and 0.0 < r.parsed_span[0] and r.parsed_span[1] < duration:
        return False
    return response_fate(r, duration).label in ("out of range", "clamped")


def span_iou(r: ResponseRecord, gt: list[float]) -> float | None:
    """The tIoU of a response's span with the truth (its logged "iou" when there is one); None without a span."""
    if r.parsed_span is None:
        return None
    logged = r.rewards.get("iou")
    if logged is not None and math.isfinite(logged):
        return logged
    return temporal_iou(tuple(r.parsed_span), tuple(gt))
