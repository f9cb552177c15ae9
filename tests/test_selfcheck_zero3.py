"""The float32 self-check of a bf16 run (`mmpg.grouping.precise`) under ZeRO-3 on two ranks: it swaps each module's
parameter storage for a float32 copy while DeepSpeed gathers and releases the partitions around it. The run with the
check on trains bit for bit what the run with it off trains, and its figure is float32's."""

from __future__ import annotations

import json

import pytest
import torch

from train_utils import final_weights, metrics, overrides, run_cli

pytestmark = pytest.mark.slow

ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                               "stage3_prefetch_bucket_size": 0, "stage3_gather_16bit_weights_on_model_save": True}}


def test_the_float32_check_leaves_a_bf16_zero3_run_untouched(grpo_data, tmp_path):
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps(ZERO3))
    runs = {}
    for check in ("on", "off"):
        args = ["train"] + overrides(grpo_data, tmp_path, check, **{
            "deepspeed.config": str(config), "model.dtype": "bfloat16", "trainer.total_steps": 2,
            "data.batch_size": 4, "reward.function": "reward_fns:space_share", "algorithm.self_check": check})
        proc = run_cli(args, timeout=600, procs=2)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[check] = metrics(tmp_path / check)
    first = runs["on"][0]
    assert first["check/grouped_vs_repeated_max"] <= first["check/bound"] == 1e-4  # bf16 weights, float32 check
    for a, b in zip(runs["on"], runs["off"]):
        assert (a["actor/grad_norm"], a["reward/mean"]) == (b["actor/grad_norm"], b["reward/mean"])
    on, off = final_weights(tmp_path / "on", 2), final_weights(tmp_path / "off", 2)
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, off[k]) for k, v in on.items())
