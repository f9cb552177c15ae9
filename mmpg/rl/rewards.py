"""Scoring responses: the built-in grounding reward (format + accuracy, weighted) or a user's `module:function`."""

from __future__ import annotations

from typing import Callable

from mmpg.rewards import call_reward, load_reward_fn, parse_answer, sample_reward


def make_scorer(reward_cfg, think: bool) -> Callable:
    """(response text, GroundingSample) -> dict of reward components with "overall"."""
    if reward_cfg.function:
        fn = load_reward_fn(reward_cfg.function)
        return lambda text, sample: call_reward(fn, text, sample, name=reward_cfg.function)
    kwargs = dict(accuracy=reward_cfg.accuracy, format_weight=reward_cfg.format_weight,
                  accuracy_weight=reward_cfg.accuracy_weight, think=think, swap_reversed=reward_cfg.swap_reversed)
    return lambda text, sample: sample_reward(text, sample, **kwargs)


def parsed_span(text: str, sample, swap_reversed: bool = False) -> list[float] | None:
    """[start, end] the answer names, or None when it does not parse."""
    parsed = parse_answer(text, sample.duration, swap_reversed=swap_reversed)
    return [float(parsed.span[0]), float(parsed.span[1])] if parsed.ok else None
