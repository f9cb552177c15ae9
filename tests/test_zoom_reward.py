"""The zoom trajectory's reward (`mmpg.rewards.zoom.zoom_reward`): the answer's reward and the tool's terms, each
returned apart, computed by hand."""

from __future__ import annotations

import pytest

from mmpg.rewards import grounding_reward
from mmpg.rewards.zoom import zoom_reward

TRUTH = (10.0, 14.0)


def test_terms_by_hand():
    answer = grounding_reward("<think>x</think><answer>10.0 to 14.0</answer>", TRUTH, 60.0)
    assert answer["overall"] == 2.0
    # two zooms, one error turn, the last window [9, 15] against [10, 14]: tIoU 4 / 6
    r = zoom_reward(answer, [(0.0, 20.0), (9.0, 15.0)], 1, TRUTH, call_cost=0.1, error_penalty=0.25,
                    window_weight=0.5)
    assert r["answer"] == 2.0 and r["zoom_calls"] == 2.0 and r["zoom_errors"] == 1.0
    assert r["zoom_window_iou"] == pytest.approx(4 / 6)
    assert r["zoom_cost"] == pytest.approx(-0.2) and r["zoom_error_penalty"] == pytest.approx(-0.25)
    assert r["zoom_window"] == pytest.approx(0.5 * 4 / 6)
    assert r["overall"] == pytest.approx(2.0 - 0.2 - 0.25 + 0.5 * 4 / 6)
    assert r["format"] == 1.0 and r["iou"] == 1.0  # the answer's own entries kept


def test_defaults_leave_the_answer_alone_and_inflated_windows_score_little():
    answer = {"overall": 0.7, "format": 1.0}
    assert zoom_reward(answer, [], 0, TRUTH)["overall"] == 0.7
    assert zoom_reward(answer, [(5.0, 6.0)], 3, TRUTH)["overall"] == 0.7  # costs off by default
    whole = zoom_reward(answer, [(0.0, 60.0)], 0, TRUTH, window_weight=1.0)["zoom_window_iou"]
    tight = zoom_reward(answer, [(10.5, 14.0)], 0, TRUTH, window_weight=1.0)["zoom_window_iou"]
    assert whole == pytest.approx(4 / 60) and tight == pytest.approx(3.5 / 4)
    assert zoom_reward(answer, [], 0, TRUTH, window_weight=1.0)["zoom_window_iou"] == 0.0


@pytest.mark.parametrize("kw", [{"call_cost": -0.1}, {"error_penalty": float("nan")}, {"window_weight": float("inf")}])
def test_bad_weights_are_named(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        zoom_reward({"overall": 1.0}, [], 0, TRUTH, **kw)
