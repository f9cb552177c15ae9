"""Rewards against values worked out by hand (arithmetic in the comment next to each expected value)."""

import sys
import types

import pytest

from mmpg.data.samples import GroundingSample
from mmpg.errors import UserError
from mmpg.rewards import (call_reward, format_reward, grounding_reward, iou_v2, load_reward_fn, parse_answer,
                          sample_reward, temporal_iou)

GOOD = "<think>the door opens late</think>\n<answer>{}</answer>"


@pytest.mark.parametrize("pred,gt,expected", [
    ((2.0, 6.0), (4.0, 8.0), 1 / 3),  # inter 6-4 = 2, union 8-2 = 6 -> 2/6
    ((0.0, 10.0), (2.0, 4.0), 0.2),  # gt inside pred: inter 2, union 10 -> 0.2
    ((3.0, 5.0), (3.0, 5.0), 1.0),  # identical
    ((0.0, 2.0), (2.0, 4.0), 0.0),  # touching at 2: inter 0
    ((0.0, 1.0), (5.0, 9.0), 0.0),  # disjoint
    ((1.5, 4.5), (2.0, 6.0), 5 / 9),  # inter [2, 4.5] = 2.5, union [1.5, 6] = 4.5 -> 2.5/4.5 = 5/9
])
def test_temporal_iou(pred, gt, expected):
    assert temporal_iou(pred, gt) == pytest.approx(expected)
    assert temporal_iou(gt, pred) == pytest.approx(expected)  # symmetric


def test_iou_v2_hand_computed():
    # pred (2, 6), gt (4, 8), d = 20: tIoU = 1/3; start factor 1 - |4-2|/20 = 0.9; end factor 1 - |8-6|/20 = 0.9
    # -> 1/3 * 0.9 * 0.9 = 0.27
    assert iou_v2((2.0, 6.0), (4.0, 8.0), 20.0) == pytest.approx(0.27)
    # pred (0, 10), gt (2, 4), d = 10: tIoU = 0.2; factors 1 - 2/10 = 0.8 and 1 - 6/10 = 0.4 -> 0.2*0.8*0.4 = 0.064
    assert iou_v2((0.0, 10.0), (2.0, 4.0), 10.0) == pytest.approx(0.064)
    # exact hit: 1 * 1 * 1 = 1
    assert iou_v2((3.0, 5.0), (3.0, 5.0), 30.0) == 1.0
    # no overlap: tIoU 0 -> 0 whatever the factors
    assert iou_v2((0.0, 1.0), (5.0, 9.0), 10.0) == 0.0
    with pytest.raises(ValueError, match="positive duration"):
        iou_v2((0.0, 1.0), (0.0, 1.0), 0.0)


@pytest.mark.parametrize("text,think,expected", [
    ("<think>a</think><answer>1 to 2</answer>", True, 1.0),
    ("  <think>\na\n</think>\n\n<answer>1 to 2</answer>\n", True, 1.0),  # whitespace around is fine
    ("<answer>1 to 2</answer>", True, 0.0),  # think missing
    ("<answer>1 to 2</answer>", False, 1.0),  # ... allowed when the template does not ask for it
    ("<think>a</think><answer>1 to 2</answer>", False, 1.0),
    ("<think>a</think><answer>1</answer><answer>2</answer>", True, 0.0),  # two answers
    ("<think>a<think>b</think></think><answer>1 to 2</answer>", True, 0.0),  # nested think
    ("<answer>1 to 2</answer><think>a</think>", True, 0.0),  # wrong order
    ("<think>a</think><answer>1 to 2</answer> trailing", True, 0.0),  # text after the answer
    ("prefix <think>a</think><answer>1 to 2</answer>", True, 0.0),  # text before think
    ("<think>a</think><answer>1 to 2", True, 0.0),  # unclosed
    ("", True, 0.0),
])
def test_format_reward(text, think, expected):
    assert format_reward(text, think) == expected


def test_grounding_reward_components():
    # answer 2 to 6, gt (4, 8), d = 20: format 1; tIoU 1/3; iou_v2 = 1/3*0.9*0.9 = 0.27; overall = 1*1 + 1*0.27
    r = grounding_reward(GOOD.format("2 to 6"), (4.0, 8.0), 20.0)
    assert r == pytest.approx({"overall": 1.27, "format": 1.0, "accuracy": 0.27, "iou": 1 / 3, "iou_v2": 0.27,
                               "parsed": 1.0})


def test_grounding_reward_weights_and_plain_iou():
    # accuracy = tIoU = 1/3; overall = 0.1*1 + 0.9*(1/3) = 0.1 + 0.3 = 0.4
    r = grounding_reward(GOOD.format("2 to 6"), (4.0, 8.0), 20.0, accuracy="iou", format_weight=0.1,
                         accuracy_weight=0.9)
    assert r["overall"] == pytest.approx(0.4)
    assert r["accuracy"] == pytest.approx(1 / 3)


def test_grounding_reward_bad_format_good_answer():
    # no think: format 0; answer 4 to 8 equals gt: iou 1, iou_v2 1*1*1 = 1; overall 0 + 1 = 1
    r = grounding_reward("<answer>4 to 8</answer>", (4.0, 8.0), 20.0)
    assert r == {"overall": 1.0, "format": 0.0, "accuracy": 1.0, "iou": 1.0, "iou_v2": 1.0, "parsed": 1.0}


def test_grounding_reward_unparsable_answer():
    # well-formed but no span: format 1, accuracy 0 -> overall 1
    r = grounding_reward(GOOD.format("no idea"), (4.0, 8.0), 20.0)
    assert r == {"overall": 1.0, "format": 1.0, "accuracy": 0.0, "iou": 0.0, "iou_v2": 0.0, "parsed": 0.0}


def test_grounding_reward_clamped_prediction():
    # answer 10 to 50 in a 20 s video is clamped to (10, 20); gt (15, 20): inter 5, union 10 -> tIoU 0.5
    # iou_v2 = 0.5 * (1 - 5/20) * (1 - 0/20) = 0.5 * 0.75 = 0.375
    r = grounding_reward(GOOD.format("10 to 50"), (15.0, 20.0), 20.0)
    assert r["iou"] == pytest.approx(0.5)
    assert r["iou_v2"] == pytest.approx(0.375)


def test_grounding_reward_reversed_answer():
    # "6 to 2" is rejected by default (accuracy 0); swapped it is (2, 6): iou_v2 0.27 as above
    assert grounding_reward(GOOD.format("6 to 2"), (4.0, 8.0), 20.0)["accuracy"] == 0.0
    swapped = grounding_reward(GOOD.format("6 to 2"), (4.0, 8.0), 20.0, swap_reversed=True)
    assert swapped["accuracy"] == pytest.approx(0.27)


def test_sample_reward_needs_duration():
    sample = GroundingSample("v#0", "v.mp4", None, "q", (4.0, 8.0))
    with pytest.raises(ValueError, match="v#0 has no duration"):
        sample_reward(GOOD.format("2 to 6"), sample)
    full = GroundingSample("v#0", "v.mp4", 20.0, "q", (4.0, 8.0))
    assert sample_reward(GOOD.format("2 to 6"), full)["overall"] == pytest.approx(1.27)  # as above


@pytest.fixture
def user_module(monkeypatch):
    mod = types.ModuleType("mmpg_test_user_rewards")
    mod.as_float = lambda response, sample: 0.5
    mod.as_dict = lambda response, sample: {"overall": 2, "bonus": 1}
    mod.no_overall = lambda response, sample: {"bonus": 1.0}
    mod.infinite = lambda response, sample: float("inf")
    mod.not_callable = 3
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod.__name__


def test_load_and_call_user_reward(user_module):
    sample = GroundingSample("v#0", "v.mp4", 20.0, "q", (4.0, 8.0))
    assert call_reward(load_reward_fn(f"{user_module}:as_float"), "x", sample) == {"overall": 0.5}
    assert call_reward(load_reward_fn(f"{user_module}:as_dict"), "x", sample) == {"overall": 2.0, "bonus": 1.0}
    with pytest.raises(UserError, match='"overall"'):
        call_reward(load_reward_fn(f"{user_module}:no_overall"), "x", sample)
    with pytest.raises(UserError, match="finite"):
        call_reward(load_reward_fn(f"{user_module}:infinite"), "x", sample)


@pytest.mark.parametrize("spec,message", [
    ("no_colon", "must look like"),
    (":fn", "must look like"),
    ("mmpg_no_such_module_xyz:fn", "cannot import module"),
    ("mmpg.rewards.grounding:no_such_fn", "has no attribute 'no_such_fn'"),
    ("mmpg_test_user_rewards:not_callable", "not a function"),
])
def test_load_reward_fn_errors(user_module, spec, message):
    with pytest.raises(UserError, match=message):
        load_reward_fn(spec)


def test_the_trainer_scores_and_records_an_answer_from_one_parse(user_module, monkeypatch):
    """The trainer's scorer parses each answer once: the built-in reward scores that parse, and the same parse gives
    the span the rollout record shows (before, step_log parsed every answer a second time); a user's function still
    gets the span recorded from mmpg's parse."""
    import mmpg.rewards.grounding as grounding
    import mmpg.rl.rewards as rl_rewards
    from mmpg.config import load_config

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0])
        return parse_answer(*args, **kwargs)

    monkeypatch.setattr(grounding, "parse_answer", counting)
    monkeypatch.setattr(rl_rewards, "parse_answer", counting)
    sample = GroundingSample("v#0", "v.mp4", 20.0, "q", (4.0, 8.0))
    cfg = load_config(None, ["reward.swap_reversed=true"])
    scored = rl_rewards.make_scorer(cfg.reward, think=True)(GOOD.format("6 to 2"), sample)
    assert len(calls) == 1
    assert scored.span == [2.0, 6.0] and scored.rewards == sample_reward(GOOD.format("2 to 6"), sample)
    unparsed = rl_rewards.make_scorer(cfg.reward, think=True)("<answer>soon</answer>", sample)
    assert unparsed.span is None and unparsed.rewards["parsed"] == 0.0
    user = load_config(None, [f"reward.function={user_module}:as_dict"])
    scored = rl_rewards.make_scorer(user.reward, think=True)(GOOD.format("2 to 6"), sample)
    assert scored.rewards == {"overall": 2.0, "bonus": 1.0} and scored.span == [2.0, 6.0]
