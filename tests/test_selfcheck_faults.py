"""Faults the self-check missed before it ran the step's own layout with autograd recording (tests/injected_faults.py,
wrapping the grouped attention without any hook of mmpg's): a fault in the second group of a packed row, one in the
backward only, one only while autograd records, and a sibling leak on weights whose logprobs hide it. Each is caught
in-process by `SelfCheck(gradients=True)` on a row of two groups, and end to end by `mmpg train` (stop: one line on
stderr, the same line in train.log, `self_check: stopped` in run.json)."""

from __future__ import annotations

import json

import pytest
import torch

import injected_faults
from batches import completions, vl_batch
from mmpg.grouping.selfcheck import SelfCheck, SelfCheckError
from train_utils import env, metrics, overrides, run_cli

VIDEOS, GROUPS, LENGTHS = [(8, 56, 84), (8, 56, 84)], [4, 3], [3, 6, 2, 5, 4, 1, 7]


@pytest.fixture
def row(load_tiny):
    """Two prompts of 4 and 3 responses: one packed row of two groups, as the update packs a micro-batch."""
    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size)
    yield model, inputs, ids, mask
    injected_faults.uninstall()


def _check(row, **kw) -> dict:
    model, inputs, ids, mask = row
    return SelfCheck("warn").run(model, inputs, ids, mask, GROUPS, backend="sdpa", **kw)


def _flatten_head(model, factor: float = 0.01) -> None:
    """Weights whose logprobs barely move with the hidden states (a confident or nearly flat head, as after SFT): a
    leak then moves them less than the 1e-4 grouped-vs-repeated bound."""
    assert not model.config.get_text_config().tie_word_embeddings
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)


def test_a_correct_forward_passes_every_figure_and_the_leak_probe_is_exact(row):
    m = _check(row, gradients=True)
    assert m["check/leak_max"] == 0.0  # a masked token adds an exact zero
    assert m["check/grouped_vs_repeated_max"] < 1e-5 and m["check/with_grad_max"] < 1e-5
    assert m["check/gradient_rel_max"] < 1e-5 < m["check/gradient_rel_bound"]


@pytest.mark.parametrize("fault, figure", [
    ("later_group", "check/grouped_vs_repeated_max"),
    ("backward", "check/gradient_rel_max"),
    ("grad_mode", "check/with_grad_max"),
])
def test_each_fault_is_caught_by_its_figure(row, fault, figure):
    """The figure that sees each fault is over its bound (measured, float32, 2 layers: 0.0036, 0.017, 0.00014 against
    1e-4), and the figures blind to it stay within theirs: each figure is needed."""
    injected_faults.install(fault)
    m = _check(row, gradients=True)
    bound = {"check/grouped_vs_repeated_max": "check/bound", "check/gradient_rel_max": "check/gradient_rel_bound",
             "check/with_grad_max": "check/with_grad_bound"}
    assert m[figure] > m[bound[figure]], m
    if fault != "later_group":
        assert m["check/grouped_vs_repeated_max"] <= m["check/bound"], m  # the forward-only check passes it
    model, inputs, ids, mask = row
    with pytest.raises(SelfCheckError):
        SelfCheck("on").run(model, inputs, ids, mask, GROUPS, backend="sdpa", gradients=True)


def test_a_later_group_fault_is_unseen_by_one_group_alone(row):
    """Why the check runs the step's packed row: the first group of a row is right, so one group alone passes."""
    model, inputs, ids, mask = row
    injected_faults.install("later_group")
    one = {k: (v[:1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v) for k, v in inputs.items()}
    one["pixel_values_videos"] = inputs["pixel_values_videos"][: inputs["pixel_values_videos"].shape[0] // 2]
    one["video_grid_thw"] = inputs["video_grid_thw"][:1]
    if "second_per_grid_ts" in inputs:
        one["second_per_grid_ts"] = inputs["second_per_grid_ts"][:1]
    m = SelfCheck("warn").run(model, one, ids[:4], mask[:4], [4], backend="sdpa", gradients=True)
    assert m["check/grouped_vs_repeated_max"] <= m["check/bound"] and m["check/leak_max"] == 0.0


def test_a_sibling_leak_hidden_by_the_weights_is_caught_by_the_leak_probe(row):
    """On weights whose logprobs hide the leak (measured 6.7e-5 < the 1e-4 bound) the leak probe sees it (3.5e-5
    against its bound of 1e-6; a correct forward gives exactly 0)."""
    model = row[0]
    _flatten_head(model)
    assert _check(row, gradients=True)["check/leak_max"] == 0.0
    injected_faults.install("sibling_leak")
    m = _check(row, gradients=True)
    assert m["check/grouped_vs_repeated_max"] <= m["check/bound"], m  # the logprob comparison alone misses it
    assert m["check/leak_max"] > 10 * m["check/leak_bound"], m


@pytest.fixture(scope="module")
def flat_model(tiny_dirs, tmp_path_factory):
    """The tiny Qwen2.5-VL checkpoint with its head made nearly flat (`_flatten_head`), saved as a user's."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = tmp_path_factory.mktemp("flat") / "q25"
    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32)
    _flatten_head(model)
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(tiny_dirs["qwen2_5_vl"]).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("fault, words", [
    ("later_group", "differs from the repeated forward by"),
    ("backward", "has gradients"),
    ("grad_mode", "while autograd records"),
    ("sibling_leak", "leaks between responses"),
])
def test_training_stops_on_each_fault_and_says_so_everywhere(grpo_data, flat_model, tmp_path, fault, words):
    """`mmpg train` with two groups per micro-batch row (rollout.n 4, micro-batch 8): the first step's self-check
    stops the run before any update: one line on stderr, the same in train.log, run.json's fast_paths say
    `self_check: stopped` with the line. The leak runs on the flat-headed weights."""
    model = flat_model if fault == "sibling_leak" else grpo_data["model"]
    extra = {"reward.function": "injected_faults:digit_share", "trainer.total_steps": 1,
             "trainer.micro_batch_size": 8, "model.path": model}
    environ = dict(env(), MMPG_TEST_FAULT=fault)
    proc = run_cli(["train"] + overrides(grpo_data, tmp_path, "faulty", **extra), timeout=300, environ=environ)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "self-check: the grouped forward" in line]
    assert len(lines) == 1 and lines[0].startswith("mmpg: error: self-check:"), proc.stderr[-3000:]
    assert words in lines[0] and "Traceback" not in proc.stderr, lines[0]
    run = tmp_path / "faulty"
    log = (run / "train.log").read_text()
    assert "run stopped: self-check: the grouped forward" in log and words in log, log[-2000:]
    fast = json.loads((run / "run.json").read_text())["fast_paths"]
    assert fast["self_check"]["value"] == "stopped" and words in fast["self_check"]["why"], fast
    assert not (run / "metrics.jsonl").exists() or not metrics(run)


def test_a_warned_run_goes_on_and_records_it(grpo_data, tmp_path):
    extra = {"reward.function": "injected_faults:digit_share", "trainer.total_steps": 1,
             "trainer.micro_batch_size": 8, "algorithm.self_check": "warn"}
    proc = run_cli(["train"] + overrides(grpo_data, tmp_path, "warned", **extra), timeout=300,
                   environ=dict(env(), MMPG_TEST_FAULT="backward"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics(tmp_path / "warned")[0]
    assert m["check/gradient_rel_max"] > m["check/gradient_rel_bound"] and m["check/groups"] == 2, m
    fast = json.loads((tmp_path / "warned" / "run.json").read_text())["fast_paths"]
    assert fast["self_check"]["value"] == "warned" and "has gradients" in fast["self_check"]["why"], fast
