"""Scoring responses: the built-in grounding reward (format + accuracy, weighted) or a user's `module:function`,
and the span each answer names (for the rollout records), from the one parse of the answer."""

from __future__ import annotations

import dataclasses
from typing import Callable

from mmpg.rewards import call_reward, load_reward_fn, parse_answer, sample_reward


@dataclasses.dataclass(frozen=True)
class Scored:
    """One response scored: its reward components ("overall" included) and the [start, end] its answer names
    (None when it does not parse)."""

    rewards: dict[str, float]
    span: list[float] | None


def make_scorer(reward_cfg, think: bool) -> Callable:
    """(response text, GroundingSample) -> Scored. The answer is parsed once: the built-in reward scores that parse;
    a user's function scores the text its own way, and the span recorded is still mmpg's parse."""
    fn = load_reward_fn(reward_cfg.function) if reward_cfg.function else None
    kwargs = dict(accuracy=reward_cfg.accuracy, format_weight=reward_cfg.format_weight,
                  accuracy_weight=reward_cfg.accuracy_weight, think=think, swap_reversed=reward_cfg.swap_reversed)

    def score(text: str, sample) -> Scored:
        parsed = parse_answer(text, sample.duration, swap_reversed=reward_cfg.swap_reversed)
        if fn is not None:
            rewards = call_reward(fn, text, sample, name=reward_cfg.function)
        else:
            rewards = sample_reward(text, sample, parsed=parsed, **kwargs)
        return Scored(rewards, [float(parsed.span[0]), float(parsed.span[1])] if parsed.ok else None)

    return score


def score_groups(scorer: Callable, groups, zoom=None) -> None:
    """Each group's `rewards` and `spans`, one `scorer` call per response (of a multi-turn trajectory: its last
    turn, the answer). `zoom` (the zoom.* config, with multi-turn groups): each trajectory's reward adds the tool's
    terms (`mmpg.rewards.zoom.zoom_reward`: call cost, error penalty, the last window's tIoU), each kept apart."""
    for g in groups:
        scored = [scorer(text, g.sample) for text in g.texts]
        g.rewards, g.spans = [s.rewards for s in scored], [s.span for s in scored]
        if zoom is not None and g.tools is not None:
            from mmpg.rewards.zoom import zoom_reward

            g.rewards = [zoom_reward(r, [t.window for t in tools if t.window is not None],
                                     sum(t.error is not None for t in tools), g.sample.span,
                                     call_cost=zoom.call_cost, error_penalty=zoom.error_penalty,
                                     window_weight=zoom.window_weight)
                         for r, tools in zip(g.rewards, g.tools)]
