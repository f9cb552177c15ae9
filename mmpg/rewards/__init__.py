"""mmpg.rewards: answer parsing and grounding rewards (pure functions, no tensors)."""

from mmpg.rewards.grounding import (
    RewardFn,
    call_reward,
    format_reward,
    grounding_reward,
    iou_v2,
    load_reward_fn,
    sample_reward,
    temporal_iou,
)
from mmpg.rewards.parse import ParsedAnswer, extract_answer, parse_answer, parse_time

__all__ = [
    "ParsedAnswer",
    "RewardFn",
    "call_reward",
    "extract_answer",
    "format_reward",
    "grounding_reward",
    "iou_v2",
    "load_reward_fn",
    "parse_answer",
    "parse_time",
    "sample_reward",
    "temporal_iou",
]
