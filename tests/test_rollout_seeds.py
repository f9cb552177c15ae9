"""Per-prompt seeds and synced decoding in `HFEngine`.

prompt_seeds: response j of prompt b draws one uniform per step from its own generator seeded by (seed_b, j) and picks
its token by inverse CDF, so a prompt's responses are the same whichever prompts share its batch (a trainer that
splits a global batch over ranks samples what one process samples). Checked token for token against the prompt
generated alone; the inverse-CDF draw itself is checked by hand, at its edges and by frequencies.

all_done: under ZeRO-3 every rank must run the same number of forwards. Another rank is simulated in-process by an
`all_done` that reports "everyone done" only at its K-th call; the rollout must not change, and the forwards (counted
on the decoder) must be the prefill, one per decode step, then one-token idle steps up to the K-th call, never past
max_new_tokens. Float32 tiny models, in the default cascade decode mode, and once (Qwen3-VL) in the copy mode."""

from __future__ import annotations

import math

import pytest
import torch

from batches import assert_recompute_matches, text_batch, vl_batch
from mmpg.grouping.inputs import split_visuals_per_prompt
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout.sampling import next_tokens

VL = ["qwen2_5_vl", "qwen3_vl"]
VIDEOS = [(4, 56, 84), None, (6, 56, 112)]  # two videos of different sizes and a text-only prompt, as test_rollout
SEEDS = [11, 22, 33]
SIZES = [2, 1, 3]
LOGP_ATOL = 1e-4  # as test_rollout: |rollout logprob - grouped_logprobs recompute| in float32


def _alone(model, inputs, b: int) -> dict:
    """Prompt b of a processor batch as a one-prompt batch: its tokens without padding and only its own visuals."""
    keep = inputs["attention_mask"][b].bool()
    one = {k: inputs[k][b:b + 1, keep] for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inputs}
    one.update(split_visuals_per_prompt(model, inputs)[b])
    return one


def _rows(rollout, b: int) -> list[list[int]]:
    """The token ids of prompt b's responses, each cut at its length."""
    return [rollout.completion_ids[i, :n].tolist()
            for i, (p, n) in enumerate(zip(rollout.prompt_index.tolist(), rollout.lengths)) if p == b]


# ---- inverse-CDF sampling, by hand ----------------------------------------------------------------------------------
def test_uniforms_pick_by_cumulative_probability():
    # probabilities .1 .2 .3 .4, cumulative .1 .3 .6 1: u picks the first token whose cumulative value exceeds it
    logits = torch.tensor([[math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]]).expand(4, 4)
    u = torch.tensor([0.05, 0.25, 0.59, 0.61], dtype=torch.float64)
    tokens, lp = next_tokens(logits, 1.0, 0, 1.0, None, uniforms=u)
    assert tokens.tolist() == [0, 1, 2, 3]
    # the returned logprob is the policy's, as without uniforms
    assert torch.allclose(lp, torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])), atol=1e-6)


@pytest.mark.parametrize("u, expected", [
    (0.0, 2),  # the first token of positive probability in vocabulary order, not token 0 (banned)
    (0.999999, 3),  # the last token of positive probability, not id 4 (filtered out by top-k)
    (1 - 1e-9, 3),  # rounds to 1.0 in float32: u * total == total, no cumulative value exceeds it
    (1 - 2 ** -53, 3),  # the largest float64 below 1, which torch.rand(dtype=float64) can return
])
def test_uniforms_at_the_edges_never_pick_a_zero_probability_token(u, expected):
    # ids 0..4, logits 5 1 3 2 0; id 0 banned, top-k 2 of the rest keeps ids 2 (logit 3) and 3 (logit 2) only
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0, 0.0]])
    tokens, _ = next_tokens(logits, 1.0, 2, 1.0, None, torch.tensor([0]), torch.tensor([u], dtype=torch.float64))
    assert tokens.tolist() == [expected]


def test_top_k_1_and_tiny_top_p_with_uniforms_are_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g) * 3
    u = torch.cat([torch.tensor([0.0, 0.999999, 1 - 2 ** -53], dtype=torch.float64),
                   torch.rand(61, generator=g, dtype=torch.float64)])
    argmax = logits.argmax(dim=-1)
    for top_k, top_p in ((1, 1.0), (0, 1e-6)):
        tokens, _ = next_tokens(logits, 0.7, top_k, top_p, None, uniforms=u)
        assert torch.equal(tokens, argmax), f"top_k={top_k}, top_p={top_p}: rows {(tokens != argmax).nonzero()}"


def test_uniforms_sample_the_filtered_distribution():
    """20000 draws from probabilities .05 .1 .2 .25 .4: each frequency within 0.01 (its standard error is at most
    sqrt(.4 * .6 / 20000) = 0.0035). With top-k 3 the distribution is .2 .25 .4 renormalised, the rest never drawn."""
    probs = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])
    n = 20000
    logits = probs.log()[None].expand(n, 5)
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for top_k, expected in ((0, probs), (3, torch.tensor([0, 0, 0.2, 0.25, 0.4]) / 0.85)):
        tokens, _ = next_tokens(logits, 1.0, top_k, 1.0, None, uniforms=u)
        freq = torch.bincount(tokens, minlength=5).float() / n
        assert float((freq - expected).abs().max()) < 0.01, f"top_k={top_k}: {freq.tolist()} vs {expected.tolist()}"
        assert torch.all(freq[expected == 0] == 0)


# ---- per-prompt seeds on tiny models ------------------------------------------------------------------------------
# the four top-k / top-p combinations, two per family
@pytest.mark.parametrize("family, filters", [
    ("qwen2_5_vl", [(0, 1.0), (20, 0.9)]), ("qwen3_vl", [(20, 1.0), (0, 0.9)]),
])
def test_prompt_seeds_make_each_prompt_independent_of_its_batch(family, filters, load_tiny):
    """Each prompt of a 3-prompt batch (two videos, one text-only; left-padded; groups 2, 1, 3) gets exactly the
    tokens it gets alone with its own seed. Exact equality: float32 logits of a batch and of one prompt may differ in
    the last bits, which could flip a token only if a uniform fell within ~1e-7 of a cumulative boundary; on these
    models and seeds it does not, so a failure here means the draws depend on the batch."""
    model, processor = load_tiny(family)
    inputs = vl_batch(processor, family, VIDEOS)
    engine = HFEngine(model, processor)
    for top_k, top_p in filters:
        sampling = SamplingParams(max_new_tokens=5, temperature=1.0, top_k=top_k, top_p=top_p, stop_token_ids=())
        batch = engine.generate_groups(inputs, SIZES, sampling, prompt_seeds=SEEDS)
        for b in range(len(SEEDS)):
            alone = engine.generate_groups(_alone(model, inputs, b), SIZES[b], sampling, prompt_seeds=[SEEDS[b]])
            assert _rows(batch, b) == _rows(alone, 0), f"top_k={top_k}, top_p={top_p}: prompt {b} batch != alone"
        rows = batch.completion_ids
        assert not torch.equal(rows[0], rows[1]), "responses of one prompt must be drawn independently"


def test_prompt_seeds_reproducible_and_replace_sampling_seed(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    engine = HFEngine(model, processor)
    sampling = SamplingParams(max_new_tokens=4, stop_token_ids=(), seed=0)
    a = engine.generate_groups(inputs, SIZES, sampling, prompt_seeds=SEEDS)
    again = engine.generate_groups(inputs, SIZES, sampling, prompt_seeds=SEEDS)
    assert torch.equal(a.completion_ids, again.completion_ids) and torch.equal(a.logprobs, again.logprobs)
    # sampling.seed is unused once prompt seeds are given
    other_seed = engine.generate_groups(inputs, SIZES, SamplingParams(max_new_tokens=4, stop_token_ids=(), seed=5),
                                        prompt_seeds=SEEDS)
    assert torch.equal(a.completion_ids, other_seed.completion_ids)
    # a new seed for prompt 0 changes its responses and nothing else
    b = engine.generate_groups(inputs, SIZES, sampling, prompt_seeds=[12, 22, 33])
    assert _rows(a, 0) != _rows(b, 0)
    assert _rows(a, 0)[0] != _rows(b, 0)[0] and _rows(a, 0)[1] != _rows(b, 0)[1]
    assert _rows(a, 1) == _rows(b, 1) and _rows(a, 2) == _rows(b, 2)
    # and without prompt seeds the engine still samples from sampling.seed, differently
    unseeded = engine.generate_groups(inputs, SIZES, sampling)
    assert not torch.equal(a.completion_ids, unseeded.completion_ids)


@pytest.mark.parametrize("family", VL)
def test_prompt_seeds_logprobs_match_grouped_recompute(family, load_tiny):
    model, processor = load_tiny(family)
    inputs = vl_batch(processor, family, VIDEOS)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=50, top_p=0.9)
    rollout = HFEngine(model, processor).generate_groups(inputs, SIZES, sampling, prompt_seeds=SEEDS)
    assert_recompute_matches(model, inputs, rollout, sampling.temperature, LOGP_ATOL)


def test_greedy_ignores_prompt_seeds(load_tiny):
    model, processor = load_tiny("qwen3_vl")
    inputs = vl_batch(processor, "qwen3_vl", VIDEOS)
    engine = HFEngine(model, processor)
    greedy = SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=())
    plain = engine.generate_groups(inputs, SIZES, greedy)
    seeded = engine.generate_groups(inputs, SIZES, greedy, prompt_seeds=SEEDS)
    assert torch.equal(seeded.completion_ids, plain.completion_ids) and torch.equal(seeded.logprobs, plain.logprobs)


@pytest.mark.parametrize("seeds", [[11, 22], [11, 22, 33, 44], []])
def test_prompt_seeds_of_wrong_length(seeds, load_tiny):
    model, tokenizer = load_tiny("qwen2")
    with pytest.raises(ValueError, match=f"{len(seeds)} prompt seeds for 3 prompts"):
        HFEngine(model, tokenizer).generate_groups(text_batch(tokenizer, 3), 2, SamplingParams(), prompt_seeds=seeds)


# ---- synced decoding (ZeRO-3) -------------------------------------------------------------------------------------
class _OtherRank:
    """all_done for a simulated second rank that finishes at this rank's `finish_at`-th call: returns this rank's
    flag AND the other's, and logs each call's argument into the shared event log."""

    def __init__(self, finish_at: int, log: list):
        self.finish_at, self.log, self.calls = finish_at, log, 0

    def __call__(self, local_done: bool) -> bool:
        self.calls += 1
        self.log.append(("all_done", local_done))
        return local_done and self.calls >= self.finish_at


def _synced_run(model, processor, inputs, sampling, all_done, log, decode="cascade"):
    """Generate with a forward hook on the decoder that logs ("forward", batch, tokens) for every call."""
    decoder = getattr(model.model, "language_model", model.model)
    hook = decoder.register_forward_hook(lambda m, args, out: log.append(("forward", *out.last_hidden_state.shape[:2])))
    try:
        return HFEngine(model, processor, all_done=all_done, decode=decode).generate_groups(
            inputs, SIZES, sampling, prompt_seeds=SEEDS)
    finally:
        hook.remove()


@pytest.mark.parametrize("family, decode", [(f, "cascade") for f in VL + ["qwen2"]] + [("qwen3_vl", "copy")])
def test_synced_decoding_idles_until_all_ranks_are_done(family, decode, load_tiny):
    """This rank stops all its rows by step T (stop ids: every row's 3rd token, so T <= 3 < max_new_tokens); the
    simulated other rank is done at call K = T + 3. Expected, per step t: a sample, all_done(t + 1 >= T), then a
    forward: a decode step while rows are live, one pad token (batch 1, length 1) after; no forward after call K."""
    model, processor = load_tiny(family)
    inputs = vl_batch(processor, family, VIDEOS) if family in VL else text_batch(processor, 3)
    steps = 10
    free = HFEngine(model, processor).generate_groups(
        inputs, SIZES, SamplingParams(max_new_tokens=steps, stop_token_ids=()), prompt_seeds=SEEDS)
    sampling = SamplingParams(max_new_tokens=steps, stop_token_ids=tuple(set(free.completion_ids[:, 2].tolist())))

    log: list = []
    alone = _synced_run(model, processor, inputs, sampling, None, log, decode)
    local_steps = max(alone.lengths)
    assert local_steps <= 3 and log[0][0] == "forward" and len(log) == local_steps, log

    finish_at = local_steps + 3
    log = []
    synced = _synced_run(model, processor, inputs, sampling, _OtherRank(finish_at, log), log, decode)
    assert torch.equal(synced.completion_ids, alone.completion_ids)
    assert torch.equal(synced.logprobs, alone.logprobs) and synced.finish_reasons == alone.finish_reasons
    # the event log: prefill, then per step t all_done(t + 1 >= T) and a forward, no forward after the K-th call
    expected = ["forward"]
    for t in range(finish_at):
        expected.append(("all_done", t + 1 >= local_steps))
        expected += ["forward"] if t + 1 < finish_at else []
    assert [e if e[0] == "all_done" else e[0] for e in log] == expected
    assert sum(e[0] == "forward" for e in log) == local_steps + (finish_at - local_steps)  # + one idle per extra call
    idle = [e for e in log[2 * local_steps:] if e[0] == "forward"]  # after this rank's last all_done(False)
    assert len(idle) == finish_at - local_steps and all(e[1:] == (1, 1) for e in idle), idle
    if family in VL:
        assert model.model.rope_deltas is None, "idle forwards must not leave rope deltas on the model"


def test_synced_decoding_stops_at_max_new_tokens(load_tiny):
    """An all_done that never agrees cannot keep the loop going past max_new_tokens: all_done is still called once
    per step (every rank makes the same collective calls), and the forwards stop with the last step."""
    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    steps = 4
    sampling = SamplingParams(max_new_tokens=steps, stop_token_ids=())
    log: list = []
    alone = _synced_run(model, processor, inputs, sampling, None, log)
    log = []
    never = _synced_run(model, processor, inputs, sampling, lambda done: log.append(("all_done", done)) or False, log)
    assert torch.equal(never.completion_ids, alone.completion_ids) and never.lengths == [steps] * sum(SIZES)
    assert [e[0] for e in log] == ["forward"] + ["all_done", "forward"] * (steps - 1) + ["all_done"]
    assert [e[1] for e in log if e[0] == "all_done"] == [False] * (steps - 1) + [True]
