"""The shared-prefix rollout engine: greedy == per-prompt `model.generate`, returned logprobs == `grouped_logprobs`,
seeded, vision tower once, caller's mode restored, clear errors. Float32 tiny models of every family."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from batches import assert_recompute_matches, text_batch, vl_batch
from mmpg.grouping import grouped_logprobs, repeated_logprobs
from mmpg.grouping.inputs import placeholder_token_ids, split_visuals_per_prompt
from mmpg.rollout import FINISH_LENGTH, FINISH_STOP, HFEngine, RolloutEngine, SamplingParams
from mmpg.rollout.sampling import filter_top_k, filter_top_p, next_tokens

VL = ["qwen2_5_vl", "qwen3_vl"]
# prompts of different lengths: two videos of different sizes and a text-only prompt in one batch
VIDEOS = [(4, 56, 84), None, (6, 56, 112)]
LOGP_ATOL = 1e-4  # |rollout logprob - grouped_logprobs recompute|, float32 (measured: ~1e-6)


def _batch(family, processor, padding_side="left"):
    if family in VL:
        return vl_batch(processor, family, VIDEOS, padding_side)
    return text_batch(processor, 3, padding_side)


def _single_prompt(model, inputs, b: int) -> dict:
    """Prompt b alone, without padding, as a user would pass it to `model.generate`."""
    keep = inputs["attention_mask"][b].bool()
    one = {k: inputs[k][b:b + 1, keep] for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inputs}
    if "pixel_values_videos" in inputs or "pixel_values" in inputs:
        one.update(split_visuals_per_prompt(model, inputs)[b])
    return one


def _generate_reference(model, inputs, b: int, max_new_tokens: int, stop_id: int) -> list[int]:
    one = _single_prompt(model, inputs, b)
    # the engine never samples vision placeholders; generate is told the same
    banned = placeholder_token_ids(model) or None
    out = model.generate(**one, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_id,
                         suppress_tokens=banned)
    return out[0, one["input_ids"].shape[1]:].tolist()


def _check_layout(rollout, pad_id: int):
    ids, mask = rollout.completion_ids, rollout.completion_mask
    assert ids.shape == mask.shape and ids.dtype == torch.long and ids.shape[0] == sum(rollout.group_sizes)
    assert torch.all(mask[:, 1:] <= mask[:, :-1]), "mask must be right-padded"
    assert torch.all(ids[mask == 0] == pad_id)
    assert len(rollout.texts) == len(rollout.finish_reasons) == ids.shape[0]
    if rollout.logprobs is not None:
        assert rollout.logprobs.dtype == torch.float32 and torch.all(rollout.logprobs[mask == 0] == 0)
        assert torch.all(rollout.logprobs[mask == 1] <= 0)


# ---- the two "done when" equivalences -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", VL + ["qwen2"])
def test_greedy_matches_per_prompt_generate(family, load_tiny):
    """Batched, left-padded, prefilled once, groups of unequal size: every row is token-identical to `generate` on
    its prompt alone. The stop token is one the model emits mid-way for some prompt, so stop and length both occur."""
    model, processor = load_tiny(family)
    inputs = _batch(family, processor)
    engine, steps = HFEngine(model, processor), 10
    free = engine.generate_groups(inputs, 1, SamplingParams(max_new_tokens=steps, temperature=0, stop_token_ids=()))
    stop_id = int(free.completion_ids[0, 4])
    rollout = engine.generate_groups(inputs, [2, 1, 3], SamplingParams(max_new_tokens=steps, temperature=0,
                                                                       stop_token_ids=(stop_id,)))
    _check_layout(rollout, model.generation_config.pad_token_id)
    rows = rollout.prompt_index.tolist()
    reasons = set()
    for i, b in enumerate(rows):
        ref = _generate_reference(model, inputs, b, steps, stop_id)
        ref = ref[: ref.index(stop_id) + 1] if stop_id in ref else ref
        got = rollout.completion_ids[i, : rollout.lengths[i]].tolist()
        assert got == ref, f"row {i} (prompt {b}): engine {got} != generate {ref}"
        expected = FINISH_STOP if ref[-1] == stop_id else FINISH_LENGTH
        assert rollout.finish_reasons[i] == expected, f"row {i}: {rollout.finish_reasons[i]} != {expected}"
        reasons.add(expected)
    assert reasons == {FINISH_STOP, FINISH_LENGTH}
    first = rollout.completion_ids[0, : rollout.lengths[0]]
    assert rollout.texts[0] == processor.batch_decode([first], skip_special_tokens=True)[0]


@pytest.mark.parametrize("family", VL + ["qwen3"])
def test_sampling_logprobs_match_grouped_recompute(family, load_tiny):
    """The returned logprobs are log softmax(logits / T) at the sampled tokens, untruncated by top-k / top-p: exactly
    what `grouped_logprobs(temperature=T)` recomputes on the same responses."""
    model, processor = load_tiny(family)
    inputs = _batch(family, processor)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=50, top_p=0.9, seed=1)
    engine = HFEngine(model, processor)
    rollout = engine.generate_groups(inputs, [3, 1, 2], sampling)
    _check_layout(rollout, model.generation_config.pad_token_id)
    assert_recompute_matches(model, inputs, rollout, sampling.temperature, LOGP_ATOL)
    # a training loop alternates the two: sampling with the grouped-attention-patched model changes nothing
    again = engine.generate_groups(inputs, [3, 1, 2], sampling)
    assert torch.equal(again.completion_ids, rollout.completion_ids)


def test_long_video_logprobs_match_recompute_and_reference(load_tiny):
    """A 40-frame Qwen2.5-VL video with a short question: its temporal positions run past the prompt's last text
    position, where `generate`'s rope deltas (max + 1) and the model's forward (last + 1) part ways. The engine, the
    grouped forward and the repeated reference must still agree."""
    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", [(40, 56, 56)])
    rollout = HFEngine(model, processor).generate_groups(inputs, 3, SamplingParams(max_new_tokens=6, seed=2))
    args = (model, inputs, rollout.completion_ids, rollout.completion_mask, rollout.group_sizes)
    with torch.no_grad():
        grouped, reference = grouped_logprobs(*args), repeated_logprobs(*args)
    assert float((grouped - rollout.logprobs).abs().max()) <= LOGP_ATOL
    assert float((grouped - reference).abs().max()) <= LOGP_ATOL


# ---- engine behaviour ----------------------------------------------------------------------------------------------
def test_seeded_and_padding_side_independent(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    engine = HFEngine(model, processor)
    assert isinstance(engine, RolloutEngine)
    sampling = SamplingParams(max_new_tokens=6, seed=7)
    left = _batch("qwen2_5_vl", processor, "left")
    a = engine.generate_groups(left, 2, sampling)
    b = engine.generate_groups(left, 2, sampling)
    right = engine.generate_groups(_batch("qwen2_5_vl", processor, "right"), 2, sampling)
    other = engine.generate_groups(left, 2, SamplingParams(max_new_tokens=6, seed=8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.completion_ids, right.completion_ids)
    assert not torch.equal(a.completion_ids, other.completion_ids)
    # rows of one group are sampled independently, not copies of each other
    assert not torch.equal(a.completion_ids[0], a.completion_ids[1])


def test_vision_tower_once_mode_restored_no_grad(load_tiny):
    model, processor = load_tiny("qwen3_vl")
    inputs = _batch("qwen3_vl", processor)
    calls = []
    hook = model.model.visual.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    model.train()
    model.model.visual.eval()  # a mixed mode (frozen vision tower) must come back as it was
    try:
        rollout = HFEngine(model, processor).generate_groups(inputs, 8, SamplingParams(max_new_tokens=4))
    finally:
        hook.remove()
    assert calls == [inputs["pixel_values_videos"].shape[0]], f"vision tower calls (pixel rows): {calls}"
    assert model.training and model.model.language_model.training and not model.model.visual.training
    assert model.model.rope_deltas is None, "the engine must not leave stale rope deltas on the model"
    assert not rollout.logprobs.requires_grad


def test_no_logprobs_and_length_finish(load_tiny):
    model, tokenizer = load_tiny("qwen2")
    rollout = HFEngine(model, tokenizer).generate_groups(
        text_batch(tokenizer, 2), 2, SamplingParams(max_new_tokens=3, stop_token_ids=(), logprobs=False))
    assert rollout.logprobs is None
    assert rollout.completion_ids.shape == (4, 3) and rollout.lengths == [3] * 4
    assert rollout.finish_reasons == [FINISH_LENGTH] * 4


# ---- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size, match", [
    (0, "group size of prompt 0 is 0"), ([2, 0], "group size of prompt 1 is 0"), ([2], "1 group sizes for 2 prompts"),
])
def test_bad_group_size(group_size, match, load_tiny):
    model, tokenizer = load_tiny("qwen2")
    with pytest.raises(ValueError, match=match):
        HFEngine(model, tokenizer).generate_groups(text_batch(tokenizer, 2), group_size, SamplingParams())


def test_empty_batch_and_empty_prompt(load_tiny):
    model, tokenizer = load_tiny("qwen2")
    engine = HFEngine(model, tokenizer)
    inputs = text_batch(tokenizer, 2)
    empty = {k: v[:0] for k, v in inputs.items()}
    with pytest.raises(ValueError, match="prompt batch is empty"):
        engine.generate_groups(empty, 2, SamplingParams())
    inputs["attention_mask"][1] = 0
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate_groups(inputs, 2, SamplingParams())


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# ---- logits processing, against hand-worked numbers and transformers' warpers ---------------------------------------
def test_filters_by_hand():
    # probabilities .5 .3 .15 .05: top-p 0.7 needs .5 + .3 (cumulative .8 >= .7), drops .15 and .05
    logits = torch.tensor([[math.log(p) for p in (0.3, 0.05, 0.5, 0.15)]])
    assert torch.isfinite(filter_top_p(logits, 0.7)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(filter_top_k(logits, 3)).tolist() == [[True, False, True, True]]
    # top-p tiny keeps the single most likely token
    assert torch.isfinite(filter_top_p(logits, 1e-6)).tolist() == [[False, False, True, False]]


def test_filters_match_transformers_warpers():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(filter_top_k(logits, 17), TopKLogitsWarper(17)(None, logits))
    assert torch.equal(filter_top_p(logits, 0.8), TopPLogitsWarper(0.8)(None, logits))


def test_banned_tokens_are_never_sampled_but_logprob_is_untruncated():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    banned = torch.tensor([1])
    tokens, lp = next_tokens(logits, 0, 0, 1.0, None, banned)
    assert tokens.tolist() == [2, 0]  # row 0's argmax (id 1) is banned
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[[0, 1], [2, 0]])
    g = torch.Generator().manual_seed(0)
    sampled, _ = next_tokens(logits[:1].expand(64, 3).contiguous(), 1.0, 0, 1.0, g, banned)
    assert 1 not in sampled.tolist()


def test_next_tokens_logprob_is_untruncated_policy():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    tok, lp = next_tokens(logits, temperature=0.5, top_k=1, top_p=1.0, generator=g)
    assert tok.tolist() == [0]  # top-k 1 leaves only the argmax
    # policy under T = 0.5: logits 4, 2, 0, -2 -> log p(0) = 4 - log(e^4 + e^2 + 1 + e^-2), not 0
    expected = 4 - math.log(math.exp(4) + math.exp(2) + 1 + math.exp(-2))
    assert abs(float(lp) - expected) < 1e-6
    tok, lp = next_tokens(logits, temperature=0, top_k=0, top_p=1.0, generator=None)  # greedy: policy at T = 1
    assert tok.tolist() == [0] and abs(float(lp) - float(torch.log_softmax(logits, -1)[0, 0])) < 1e-6
