"""The self-check (`mmpg.grouping.selfcheck`, its bounds in `mmpg.grouping.bounds`): a 0.04 nat fault caught at 28
layers in bf16, the fallback to sdpa, its envelope, a passing check on the real forward, a wrong forward caught with
the one-line error (mode on) or a warning (mode warn), and the engine check used by evaluation."""

from __future__ import annotations

import logging

import pytest
import torch

from mmpg.grouping import grouping_state

from batches import completions, vl_batch
from mmpg.grouping.bounds import bound_for
from mmpg.grouping.selfcheck import SelfCheck, SelfCheckError, batch_dims

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


def _faulty_backends(monkeypatch, fault):
    """The grouped attention's backends with `fault(name, out, layout) -> out` applied to their output; `flex` runs
    sdpa's kernel underneath (no compile here), so a fault-free flex is exact."""
    import mmpg.grouping.attention as attention
    from mmpg.grouping.backends import get_backend

    def faulty(name):
        real = get_backend("sdpa" if name == "flex" else name)
        return lambda q, k, v, layout, scale: fault(name, real(q, k, v, layout, scale), layout)

    monkeypatch.setattr(attention, "get_backend", faulty)


def _scaled_responses(eps, only=None):
    """A fault in the grouped attention: the response tokens' attention output scaled by 1 + eps (backend `only`)."""
    def fault(name, out, layout):
        if only is not None and name != only:
            return out
        out = out.clone()
        out[0, layout.response_index] *= 1 + eps
        return out
    return fault


@pytest.fixture(scope="module")
def deep_bf16():
    """A tiny Qwen2.5-VL with 28 decoder layers (Qwen2.5-VL-7B's depth) in bf16, and one group of 4 responses."""
    from mmpg.toy.models import TinySpec, build_tiny_model, build_tiny_processor

    spec = TinySpec(num_layers=28)
    processor = build_tiny_processor("qwen2_5_vl", spec)
    model = build_tiny_model("qwen2_5_vl", spec, tokenizer=processor.tokenizer).to(torch.bfloat16)
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(torch.bfloat16)
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size)
    return model, inputs, ids, mask


def test_a_004_nat_fault_at_28_layers_is_caught_in_bf16(deep_bf16, monkeypatch):
    """The check of a bf16 run computes in float32 on the run's weights: a correct grouped forward passes far under
    the bound, and a fault of 0.04 nat (sized in float32) stops the run. The bf16 comparison's depth bound (0.175
    at 28 layers) would have let it through."""
    from mmpg.grouping import grouped_logprobs, repeated_logprobs
    from mmpg.grouping.precise import float32_compute

    model, inputs, ids, mask = deep_bf16
    m = SelfCheck("on").run(model, inputs, ids, mask, GROUPS)
    assert m["check/bound"] == 1e-4 and m["check/grouped_vs_repeated_max"] <= 1e-5  # sdpa: float32 throughout
    _faulty_backends(monkeypatch, _scaled_responses(5.0))
    with torch.no_grad(), float32_compute(model):
        fault = float((grouped_logprobs(model, inputs, ids, mask, GROUPS) -
                       repeated_logprobs(model, inputs, ids, mask, GROUPS)).abs().max())
    assert 0.03 <= fault <= 0.05, fault  # a 0.04 nat fault (0.037 measured)
    print(f"28 layers, bf16: correct grouped forward {m['check/grouped_vs_repeated_max']:.2g} (float32 check), "
          f"injected fault {fault:.3g} nat")
    old = SelfCheck("on", precise=False).run(model, inputs, ids, mask, GROUPS)  # the check as it was: passes
    assert old["check/grouped_vs_repeated_max"] <= old["check/bound"] == bound_for(model, torch.bfloat16)
    with pytest.raises(SelfCheckError, match="bound 0.0001 for bfloat16"):
        SelfCheck("on").run(model, inputs, ids, mask, GROUPS)


def test_a_16_bit_kernel_is_checked_within_its_bound(deep_bf16, monkeypatch):
    """flash / flex keep their kernel in bf16 inside the float32 check (bound 0.25 u L = 0.027 at 28 layers): the
    correct kernel (sdpa's, standing in) passes with a tenfold margin, the 0.04 nat fault of the test above does
    not."""
    import mmpg.grouping.bounds as bounds

    model, inputs, ids, mask = deep_bf16
    monkeypatch.setattr(bounds, "FLOAT32_KERNELS", ("lse_reference",))  # sdpa's kernel kept in bf16 here
    m = SelfCheck("on").run(model, inputs, ids, mask, GROUPS)
    bound = m["check/bound"]
    assert 0 < 10 * m["check/grouped_vs_repeated_max"] < bound  # the 16-bit kernel rounds, far under its bound
    _faulty_backends(monkeypatch, _scaled_responses(5.0))
    with pytest.raises(SelfCheckError, match=f"bound {bound:.3g} for bfloat16"):
        SelfCheck("on").run(model, inputs, ids, mask, GROUPS)


def test_a_failing_backend_falls_back_to_sdpa_with_one_line(group, monkeypatch, caplog):
    """A flex backend whose output is shifted, or that raises: one warning line, the model keeps sdpa, the check
    passes there and `choice` says why. When sdpa fails too the run stops."""
    from mmpg.grouping import set_grouping_options

    model, inputs, ids, mask = group

    def raises(name, out, layout):
        if name == "flex":
            raise RuntimeError("no kernel image is available for execution on the device")
        return out

    for fault, words in ((_scaled_responses(0.5, only="flex"), "flex differs by "),
                         (raises, "flex raised RuntimeError: no kernel image")):
        set_grouping_options(model, backend="flex")
        _faulty_backends(monkeypatch, fault)
        check = SelfCheck("on")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mmpg.grouping"):
            m = check.run(model, inputs, ids, mask, GROUPS)
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("mmpg")]
        assert len(lines) == 1 and lines[0].startswith(f"self-check: grouped backend {words}"), lines
        assert lines[0].endswith("falling back to sdpa") and "flash-attn " in lines[0]
        assert m["check/grouped_vs_repeated_max"] <= 1e-4 and grouping_state(model).backend == "sdpa"
        assert check.choice[0] == "sdpa" and check.choice[1].startswith(words)
        assert not check.needed(model, batch_dims(inputs, mask, GROUPS))  # the envelope is sdpa's now
    _faulty_backends(monkeypatch, _scaled_responses(0.5, only="flex"))
    with pytest.raises(SelfCheckError, match="backend flex"):  # a backend asked for by name is checked as it is
        SelfCheck("on").run(model, inputs, ids, mask, GROUPS, backend="flex")
    set_grouping_options(model, backend="flex")
    _faulty_backends(monkeypatch, _scaled_responses(0.5))  # every backend wrong
    with pytest.raises(SelfCheckError, match="backend sdpa"):
        SelfCheck("on").run(model, inputs, ids, mask, GROUPS)
    set_grouping_options(model, backend="auto")


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
    """alarm/logprob_drift: set once actor/logprob_gap_max has been above the bound for `steps` steps in a row;
    one step back under the bound resets the count; NaN counts as above."""
    from mmpg.rl.step_log import DriftAlarm

    alarm = DriftAlarm(1e-4, steps=3)
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


def test_run_json_fast_paths_are_replaced_whole_and_the_rest_kept(tmp_path):
    import json

    from mmpg.runs import RunWriter

    writer = RunWriter(tmp_path / "run", tensorboard=False)
    writer.start("a: 1\n", kind="grpo", command=["mmpg", "train"], extra={"parameters": {"text": "x"}})
    writer.set_fast_paths({"grouped_backend": {"value": "flash", "why": ""}})
    writer.set_fast_paths({"grouped_backend": {"value": "sdpa", "why": "flash differs by 0.3"},
                           "decode_kernel": {"value": "copy", "why": ""}})
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["fast_paths"] == {"grouped_backend": {"value": "sdpa", "why": "flash differs by 0.3"},
                                  "decode_kernel": {"value": "copy", "why": ""}}
    assert info["parameters"] == {"text": "x"} and info["kind"] == "grpo"
    RunWriter(tmp_path / "other", rank=1).set_fast_paths({"x": {}})  # not rank 0: nothing written
    assert not (tmp_path / "other").exists()


def test_a_model_sure_of_its_tokens_passes_and_a_backward_fault_still_stops_it(load_tiny, monkeypatch):
    """A checkpoint that samples what it was fine-tuned on is sure of every token (p > 0.99): at temperature 1 the
    gradient of log p is 1 - p, which float32 rounds to ~1e-3 relative in either layout, so a correct grouped forward
    read 9e-4 against the 1e-4 bound (the first GRPO run after a zoom SFT stopped on it). The probe runs at
    `probes.PROBE_TEMPERATURE`: the correct forward passes, a 1 % error in the attention's backward still stops it."""
    import injected_faults
    from batches import video_prompts

    from mmpg.grouping import probes, repeated_logprobs

    model, processor = load_tiny("qwen2_5_vl")
    inputs = video_prompts(processor, [0], "left")
    target = torch.randint(0, 600, (1, 48), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(200):  # memorize the completion
        loss = -repeated_logprobs(model, inputs, target, torch.ones_like(target), [1]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ids = target.repeat(4, 1)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert bool((repeated_logprobs(model, inputs, ids, mask, [4]) > -0.01).all())  # p > 0.99 everywhere
    m = SelfCheck("on").run(model, inputs, ids, mask, [4], backend="sdpa", gradients=True)
    assert m["check/gradient_rel_max"] <= 1e-5 and m["check/with_grad_max"] <= 1e-4, m  # measured 2e-7, 7.6e-6
    monkeypatch.setattr(probes, "PROBE_TEMPERATURE", 1.0)  # the probe as it was: rounding above the bound
    assert SelfCheck("warn").run(model, inputs, ids, mask, [4], backend="sdpa", gradients=True)[
        "check/gradient_rel_max"] > 1e-4
    monkeypatch.undo()
    injected_faults.install("backward")
    try:
        with pytest.raises(SelfCheckError, match="has gradients"):
            SelfCheck("on").run(model, inputs, ids, mask, [4], backend="sdpa", gradients=True)
    finally:
        injected_faults.uninstall()
