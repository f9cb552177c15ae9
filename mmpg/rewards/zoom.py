"""Rewards of a zoom trajectory (multi-turn grounding with the zoom tool): the final answer's reward, as for one
turn, and the tool's terms, each configurable and returned apart so they can be logged and inspected.

    overall = answer − call_cost · zooms − error_penalty · errors + window_weight · tIoU(last window, truth)

- `answer`: the reward of the trajectory's last model turn (`grounding_reward`'s dict, or a user reward's).
- `zooms`: tool turns that returned a clip; `call_cost` > 0 makes a zoom cost something, so the policy learns
  when one look is enough (VideoZoomer, VITAL).
- `errors`: error turns (a malformed call, a window outside the video or too long); `error_penalty` > 0.
- the last window's tIoU against the truth, weight `window_weight` (LongVT's guard against window inflation: a
  window that covers the whole video to be safe scores little). 0 when the trajectory never zoomed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mmpg.rewards.grounding import Span, temporal_iou


def zoom_reward(answer: dict[str, float], windows: Sequence[Span], errors: int, truth: Span, *,
                call_cost: float = 0.0, error_penalty: float = 0.0, window_weight: float = 0.0) -> dict[str, float]:
    """The trajectory's reward dict: the answer's entries, "answer" (its overall), "zoom_calls", "zoom_errors",
    "zoom_window_iou" and the three terms as they enter "overall" ("zoom_cost", "zoom_error_penalty",
    "zoom_window")."""
    for name, value in (("call_cost", call_cost), ("error_penalty", error_penalty), ("window_weight", window_weight)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"zoom reward {name}={value}: must be a finite number >= 0")
    if errors < 0:
        raise ValueError(f"errors={errors}: a count of error turns, >= 0")
    window_iou = temporal_iou(tuple(windows[-1]), tuple(truth)) if windows else 0.0
    cost, penalty, window = -call_cost * len(windows), -error_penalty * errors, window_weight * window_iou
    return {**answer, "answer": answer["overall"], "overall": answer["overall"] + cost + penalty + window,
            "zoom_calls": float(len(windows)), "zoom_errors": float(errors), "zoom_window_iou": window_iou,
            "zoom_cost": cost, "zoom_error_penalty": penalty, "zoom_window": window}
