"""`mmpg sft`: the target text, and a short CPU run whose loss falls, written into a run directory like `mmpg train`."""

from __future__ import annotations

import pytest

from mmpg.data.samples import GroundingSample
from mmpg.rewards import grounding_reward
from mmpg.sft.job import target_text
from train_utils import metrics, overrides, run_cli


def _sample(span):
    return GroundingSample("v#0", "v.mp4", 20.0, "a red circle appears", span)


def test_target_is_what_the_reward_scores_full_marks():
    text = target_text(_sample((3.0, 12.5)), "I look.", decimals=2)
    assert text == "<think>I look.</think><answer>3 to 12.5</answer>"
    r = grounding_reward(text, (3.0, 12.5), 20.0)
    assert r["format"] == 1.0 and r["iou"] == 1.0 and r["overall"] == 2.0
    assert target_text(_sample((1.234, 7.0)), None, decimals=1) == "<answer>1.2 to 7</answer>"


@pytest.mark.slow
def test_sft_loss_falls_and_the_run_directory_is_complete(grpo_data, tmp_path):
    args = ["sft"] + overrides(grpo_data, tmp_path, "sft", **{
        "trainer.total_steps": 12, "trainer.micro_batch_size": 1, "data.batch_size": 2, "optim.lr": 1e-3,
        "checkpoint.every_n_steps": 6, "reward.function": ""})
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = metrics(tmp_path / "sft")
    assert [m["step"] for m in lines] == list(range(1, 13))
    first, last = lines[0]["sft/loss"], lines[-1]["sft/loss"]
    assert last < first - 1.0, (first, last)  # measured: 6.6 -> 4.3 over 12 steps
    # one sample per micro-batch: the vision tower encodes each of the step's 2 prompts once
    assert all(m["perf/vision_calls"] == 2 and 1 <= m["perf/videos"] <= 2 for m in lines)
    # the slowest rank's wait for its batch, and its distinct videos each decoded once from its file
    assert all(0 < m["timing_s/data"] < m["timing_s/step"] and m["data/videos_decoded"] == m["perf/videos"]
               for m in lines)
    from mmpg.runs import RunReader

    reader = RunReader(tmp_path / "sft")
    assert reader.info()["kind"] == "sft"
    assert [s for s, _ in reader.checkpoints()] == [6, 12]
