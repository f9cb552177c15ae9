"""Rewards for video temporal grounding: pure functions of the response text and the ground truth.

With prediction (ŝ, ê), ground truth (s, e) and video duration d (seconds):

    tIoU    = |[ŝ, ê] ∩ [s, e]| / |[ŝ, ê] ∪ [s, e]|          (union = max(ê, e) - min(ŝ, s): the hull, which equals the
                                                             union when the spans overlap, and tIoU = 0 otherwise)
    iou_v2  = tIoU · (1 − |s − ŝ| / d) · (1 − |e − ê| / d)   (Time-R1, arXiv 2503.13377: also pays for boundary
                                                             distance, so the reward still ranks near misses)
    format  = 1 if the response is exactly <think>…</think><answer>…</answer> (whitespace around), else 0
    overall = format_weight · format + accuracy_weight · accuracy,   accuracy = iou_v2 (default) or tIoU

Time-R1 sums format and iou_v2 with weight 1 each, which is the default here. A response whose answer does not
parse gets accuracy 0 (its format may still count).

Every reward returns a dict of floats with at least "overall" (what the advantage uses) and its components, so
they can be logged per step and shown in the rollout viewer. A user reward is any function
`fn(response: str, sample) -> dict[str, float] | float` (sample: a `GroundingSample`), named `"module:function"`.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any, Callable

from mmpg.errors import UserError
from mmpg.rewards.parse import ParsedAnswer, parse_answer

Span = tuple[float, float]
RewardFn = Callable[[str, Any], dict[str, float]]

_NO_TAGS = r"(?:(?!</?think>|</?answer>).)*"  # text that opens or closes no think/answer tag
_THINK_ANSWER = re.compile(rf"\s*<think>{_NO_TAGS}</think>\s*<answer>{_NO_TAGS}</answer>\s*", re.DOTALL)
_MAYBE_THINK_ANSWER = re.compile(rf"\s*(?:<think>{_NO_TAGS}</think>\s*)?<answer>{_NO_TAGS}</answer>\s*", re.DOTALL)


def temporal_iou(pred: Span, gt: Span) -> float:
    """Intersection over union of two [start, end] intervals; 0 when they do not overlap or both are empty."""
    inter = min(pred[1], gt[1]) - max(pred[0], gt[0])
    if inter <= 0:
        return 0.0
    union = max(pred[1], gt[1]) - min(pred[0], gt[0])
    return inter / union


def iou_v2(pred: Span, gt: Span, duration: float) -> float:
    """Time-R1's tIoU · (1 − |s − ŝ|/d) · (1 − |e − ê|/d); each factor is floored at 0 (spans inside [0, d] never
    need it)."""
    if not duration > 0:
        raise ValueError(f"iou_v2 needs a positive duration, got {duration!r}")
    start_factor = max(0.0, 1.0 - abs(gt[0] - pred[0]) / duration)
    end_factor = max(0.0, 1.0 - abs(gt[1] - pred[1]) / duration)
    return temporal_iou(pred, gt) * start_factor * end_factor


def format_reward(response: str, think: bool = True) -> float:
    """1.0 for `<think>…</think><answer>…</answer>` and nothing else (think optional when `think=False`)."""
    pattern = _THINK_ANSWER if think else _MAYBE_THINK_ANSWER
    return 1.0 if isinstance(response, str) and pattern.fullmatch(response) else 0.0


def grounding_reward(response: str, span: Span, duration: float, *, accuracy: str = "iou_v2",
                     format_weight: float = 1.0, accuracy_weight: float = 1.0, think: bool = True,
                     swap_reversed: bool = False, parsed: ParsedAnswer | None = None) -> dict[str, float]:
    """Format + accuracy reward of one response for the ground-truth `span` in a video of `duration` seconds;
    `parsed`: the response already parsed (`parse_answer(response, duration, swap_reversed=...)`), not parsed again.

    Returns {"overall", "format", "accuracy", "iou", "iou_v2", "parsed"} (parsed: 1.0 if a span was read).
    """
    if accuracy not in ("iou_v2", "iou"):
        raise UserError(f"unknown accuracy reward {accuracy!r}; choose iou_v2 or iou")
    if parsed is None:
        parsed = parse_answer(response, duration, swap_reversed=swap_reversed)
    fmt = format_reward(response, think)
    iou = temporal_iou(parsed.span, span) if parsed.ok else 0.0
    v2 = iou_v2(parsed.span, span, duration) if parsed.ok else 0.0
    acc = v2 if accuracy == "iou_v2" else iou
    return {"overall": format_weight * fmt + accuracy_weight * acc, "format": fmt, "accuracy": acc,
            "iou": iou, "iou_v2": v2, "parsed": 1.0 if parsed.ok else 0.0}


def sample_reward(response: str, sample: Any, **kwargs) -> dict[str, float]:
    """`grounding_reward` against a GroundingSample (anything with .span, .duration, .sample_id)."""
    if sample.duration is None:
        raise ValueError(f"sample {sample.sample_id} has no duration; fill durations before computing rewards")
    return grounding_reward(response, tuple(sample.span), sample.duration, **kwargs)


def load_reward_fn(spec: str) -> RewardFn:
    """The function named by `"package.module:function"`; UserError if the module or function is missing."""
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise UserError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UserError(f"reward function {spec!r}: cannot import module {module_name!r} ({e}); check the name "
                        "and that its folder is on PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def call_reward(fn: Callable, response: str, sample: Any, name: str = "reward") -> dict[str, float]:
    """Call a reward function and check what it returned: a number becomes {"overall": x}; a dict needs a finite
    "overall" and numeric values. UserError (naming `name` and the sample) otherwise."""
    out = fn(response, sample)
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        out = {"overall": out}
    if not isinstance(out, dict) or "overall" not in out:
        raise UserError(f"{name} returned {type(out).__name__} for sample {getattr(sample, 'sample_id', '?')}; "
                        'return a number or a dict with an "overall" key')
    try:
        result = {str(k): float(v) for k, v in out.items()}
    except (TypeError, ValueError):
        raise UserError(f"{name} returned non-numeric values {out!r}; return floats only") from None
    if not math.isfinite(result["overall"]):
        raise UserError(f"{name} returned overall={result['overall']} for sample "
                        f"{getattr(sample, 'sample_id', '?')}; rewards must be finite")
    return result
