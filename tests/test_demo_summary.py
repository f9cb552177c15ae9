"""The learning demo's report pieces (pure functions), against hand-worked numbers; and its presets and CLI."""

from __future__ import annotations

import pytest

from mmpg.toy.demo.summary import Rows, reward_curve, reward_trend, sparkline


def _metrics(rewards):
    return [{"step": i + 1, "reward/mean": r, "reward/iou": r / 2} for i, r in enumerate(rewards)]


def test_reward_curve_blocks_and_trend():
    m = _metrics([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    # 7 steps in at most 3 blocks -> blocks of ceil(7 / 3) = 3 steps: (1-3), (4-6), (7)
    assert reward_curve(m, blocks=3) == [(1, 3, 2.0, 1.0), (4, 6, 5.0, 2.5), (7, 7, 7.0, 3.5)]
    # thirds of 7 steps are 2 steps: first (1 + 2) / 2, last (6 + 7) / 2
    assert reward_trend(m) == {"first_third": 1.5, "last_third": 6.5, "steps": 7.0}
    assert reward_curve([{"step": 1, "sft/loss": 0.3}]) == []


def test_sparkline_scales_to_the_range():
    assert sparkline([0.0, 1.0]) == "▁█"
    assert sparkline([1.0, 1.5, 2.0]) == "▁▅█"
    assert sparkline([3.0, 3.0]) == "▁▁"


class _Result:
    def __init__(self, metrics, folder):
        self.metrics, self.folder = metrics, folder


def test_rows_table_in_percent_in_order(tmp_path):
    rows = Rows({"whole_video": ("baseline: whole video", {"miou": 0.324, "r1@0.3": 0.5, "r1@0.5": 0.183,
                                                             "r1@0.7": 0.0, "unparseable": 0.0, "count": 60.0})})
    rows.add("sft", "SFT (150 steps)", _Result({"miou": 0.6, "r1@0.3": 0.9, "r1@0.5": 0.65, "r1@0.7": 0.3,
                                                "unparseable": float("nan"), "count": 60.0}, tmp_path))
    head, rule, whole, sft = rows.table()
    assert head.split("|")[2].strip() == "mIoU" and rule.count(":") == 5
    assert [c.strip() for c in whole.split("|")[1:-1]] == ["baseline: whole video", "32.4", "50.0", "18.3", "0.0",
                                                          "0.0"]
    assert [c.strip() for c in sft.split("|")[1:-1]][-1] == "n/a" and rows.folders == {"sft": tmp_path}
    assert rows.line("sft").startswith("mIoU 60.0, R1@0.3 90.0") and rows.to_json()["sft"]["label"] == "SFT (150 steps)"


def test_demo_cli_presets_and_bad_steps(capsys):
    from mmpg.cli import main
    from mmpg.toy.demo import PRESETS, run_demo
    from mmpg.errors import UserError

    assert PRESETS["quick"].grpo_steps < PRESETS["default"].grpo_steps < PRESETS["long"].grpo_steps
    with pytest.raises(SystemExit):
        main(["demo", "--quick", "--long"])
    assert "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--grpo-steps", "0"])
    with pytest.raises(UserError, match="at least one SFT and one GRPO step"):
        run_demo("unused", preset="quick", grpo_steps=-1)
