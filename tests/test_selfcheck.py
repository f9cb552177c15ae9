"""The self-check (`mmpg.grouping.selfcheck`): its bounds, its envelope, a passing check on the real forward, a wrong
forward caught with the one-line error (mode on) or a warning (mode warn), and the engine check used by evaluation."""

from __future__ import annotations

import logging

import pytest
import torch

from batches import completions, vl_batch
from mmpg.grouping.selfcheck import SelfCheck, SelfCheckError, batch_dims, bound_for

VIDEOS, GROUPS, LENGTHS = [(8, 56, 84)], [4], [3, 6, 2, 5]


@pytest.fixture
def loaded(load_tiny):
    return load_tiny("qwen2_5_vl")


@pytest.fixture
def group(loaded):
    model, processor = loaded
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size)
    return model, inputs, ids, mask


def test_bounds_per_dtype(group):
    model = group[0]
    assert bound_for(model, torch.float32) == 1e-4
    layers = model.config.text_config.num_hidden_layers  # 2
    assert bound_for(model, torch.bfloat16) == pytest.approx(1.6 * 2 ** -8 * layers)  # 0.0125 for 2 layers
    assert bound_for(model, torch.float16) == pytest.approx(2.0 * 2 ** -11 * layers)
    model.config.text_config.num_hidden_layers = 28
    try:
        assert bound_for(model, torch.bfloat16) == pytest.approx(0.175)  # 1.6 * 28 / 256
    finally:
        model.config.text_config.num_hidden_layers = layers


def test_passes_on_the_real_forward_and_grows_the_envelope(group):
    model, inputs, ids, mask = group
    check = SelfCheck("on")
    dims = batch_dims(inputs, mask, GROUPS)
    assert dims == (int(inputs["attention_mask"].sum()), 6, 4)
    assert check.needed(model, dims)
    m = check.run(model, inputs, ids, mask, GROUPS)
    assert 0 <= m["check/grouped_vs_repeated_max"] <= 1e-5 and m["check/bound"] == 1e-4
    assert (m["check/prefix_max"], m["check/response_max"], m["check/group_max"]) == dims
    assert not check.needed(model, dims) and not check.needed(model, (dims[0] - 1, 2, 4))
    for bigger in ((dims[0] + 1, 6, 4), (dims[0], 7, 4), (dims[0], 6, 5)):
        assert check.needed(model, bigger), bigger  # past the envelope on any one axis
    assert check.needed(model, dims, backend="lse_reference")  # another backend: not checked yet
    assert not SelfCheck("off").needed(model, dims)


def _shift_responses(monkeypatch):
    """The wrong forward of tests/perturbed_forward.py for this test only (that module patches on import, for the
    training run that imports it; here the import's own patch is undone at once and the monkeypatch restores)."""
    import mmpg.grouping.logprobs as logprobs

    real = logprobs.pack
    import perturbed_forward

    logprobs.pack = real
    monkeypatch.setattr(logprobs, "pack", perturbed_forward._shifted_pack)


def test_a_wrong_grouped_forward_stops_with_one_line(group, monkeypatch):
    model, inputs, ids, mask = group
    import mmpg.grouping.logprobs as logprobs

    real = logprobs.pack
    _shift_responses(monkeypatch)
    assert logprobs.pack is not real
    with pytest.raises(SelfCheckError) as err:
        SelfCheck("on").run(model, inputs, ids, mask, GROUPS)
    line = str(err.value)
    assert "\n" not in line and line.startswith("self-check: the grouped forward differs from the repeated forward by")
    for part in ("bound 0.0001 for float32", "backend sdpa", "torch ", "transformers ", "flash-attn ",
                 "algorithm.self_check=warn"):
        assert part in line, part
    figure = float(line.split(" by ")[1].split(" ")[0])
    assert figure > 10 * 1e-4  # the shift moves logprobs far past the float32 bound


def test_warn_mode_logs_and_goes_on(group, monkeypatch, caplog):
    model, inputs, ids, mask = group
    _shift_responses(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mmpg.grouping"):
        m = SelfCheck("warn").run(model, inputs, ids, mask, GROUPS)
    assert m["check/grouped_vs_repeated_max"] > 1e-4
    assert any("self-check: the grouped forward differs" in r.getMessage() for r in caplog.records)


def test_an_engines_logprobs_are_checked_the_same_way(loaded):
    """Evaluation checks its decode engine: the rollout's own logprobs against the repeated forward."""
    from mmpg.rollout import HFEngine, SamplingParams

    model, processor = loaded
    inputs = vl_batch(processor, "qwen2_5_vl", [(8, 56, 84), None, (4, 112, 56)])
    for decode in ("cascade", "copy"):
        r = HFEngine(model, processor, decode=decode).generate_groups(
            inputs, 1, SamplingParams(max_new_tokens=6, temperature=0.0))
        check = SelfCheck("on", what=f"{decode} decode engine")
        m = check.run(model, inputs, r.completion_ids, r.completion_mask, r.group_sizes, candidate=r.logprobs)
        assert m["check/grouped_vs_repeated_max"] <= 1e-4
        wrong = r.logprobs + 0.01 * r.completion_mask
        with pytest.raises(SelfCheckError, match=f"the {decode} decode engine differs .* by 0.01"):
            SelfCheck("on", what=f"{decode} decode engine").run(model, inputs, r.completion_ids, r.completion_mask,
                                                                 r.group_sizes, candidate=wrong)


def test_drift_alarm_after_several_steps_in_a_row():
    """alarm/logprob_drift: set once actor/logprob_gap_max has been above the bound for DRIFT_STEPS steps in a row;
    one step back under the bound resets the count; NaN counts as above."""
    from mmpg.rl.report import DRIFT_STEPS, DriftAlarm

    assert DRIFT_STEPS == 3
    alarm = DriftAlarm(1e-4)
    gaps = [5e-5, 2e-3, 3e-3, 1e-5, 2e-3, float("nan"), 4e-3, 5e-3]
    flagged = []
    for step, gap in enumerate(gaps, start=1):
        m = {"actor/logprob_gap_max": gap}
        line = alarm.update(step, m)
        assert (line is None) == ("alarm/logprob_drift" not in m)
        if line:
            flagged.append(step)
            assert line.startswith(f"logprob drift at step {step}: actor/logprob_gap_max")
    assert flagged == [7, 8]  # steps 5, 6 (NaN), 7 are the first three in a row
    assert alarm.update(9, {}) is None  # a step without the metric (skipped update) changes nothing
