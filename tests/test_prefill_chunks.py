"""Chunked prefill of long prompts (`mmpg.rollout.chunks`, `HFEngine(prefill_chunk=C)`) against the one-forward
prefill, float32 tiny models: the same greedy and seeded tokens and rollout logprobs within 1e-5, on tiny Qwen2.5-VL
and Qwen3-VL (both decode modes, left padding with unequal prompt lengths, chunk boundaries inside the video and
inside the question), the shared-video batch (shared parts in chunks, tails behind them), a text Qwen; the vision
tower in frame chunks equals the whole video's encoding; a batch shorter than one chunk takes today's path bit for
bit; synced (ZeRO-3) decoding runs one forward per vote; the settings are validated."""

from __future__ import annotations

import pytest
import torch

from batches import text_batch, vl_batch
from test_grouping_shares import GROUPS, PROMPTS, shared_batch
from test_rollout_seeds import _OtherRank
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout.chunks import _joined, chunk_spans, encode_in_chunks, supports_encoder_outputs

VL = ["qwen2_5_vl", "qwen3_vl"]
ATOL = 1e-5  # |chunked - one-forward| rollout logprob, float32
VIDEOS = [(16, 112, 112), None, (8, 56, 112)]  # unequal prompt lengths, a text-only prompt among them
SIZES = [2, 1, 3]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
SEEDED = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)


def _compare(model, processor, inputs, sizes, sampling, chunk: int, **engine_kwargs):
    """(one-forward rollout, chunked rollout); asserts the same tokens and logprobs within ATOL."""
    ref = HFEngine(model, processor, **engine_kwargs).generate_groups(inputs, sizes, sampling)
    out = HFEngine(model, processor, prefill_chunk=chunk, **engine_kwargs).generate_groups(inputs, sizes, sampling)
    assert torch.equal(out.completion_ids, ref.completion_ids), f"chunk {chunk}: tokens differ"
    diff = (out.logprobs - ref.logprobs).abs()
    worst = int(diff.argmax())
    assert float(diff.max()) <= ATOL, \
        f"chunk {chunk}: logprob diff {float(diff.max()):.3g} at row {worst // diff.shape[1]}"
    return ref, out


def _boundaries_inside(model, inputs, chunk: int) -> None:
    """Some chunk boundary falls strictly inside the longest prompt's video tokens, and one inside its text after."""
    ids = inputs["input_ids"][0]  # the longest prompt: no left padding
    video = (ids == model.config.video_token_id).nonzero()[:, 0]
    cuts = [a for a, _ in chunk_spans(ids.numel(), chunk)[1:]]
    assert any(int(video[0]) < c <= int(video[-1]) for c in cuts), "no chunk boundary inside the video"
    assert any(int(video[-1]) + 1 < c < ids.numel() for c in cuts), "no chunk boundary inside the question"


@pytest.mark.parametrize("family", VL)
def test_vision_tower_in_frame_chunks_equals_the_whole_video(family, load_tiny):
    model, processor = load_tiny(family)
    inputs = vl_batch(processor, family, [(16, 112, 112), (8, 56, 112)])
    pixels, grid = inputs["pixel_values_videos"], inputs["video_grid_thw"]
    with torch.no_grad():
        whole = model.model.get_video_features(pixels, grid, return_dict=True)
        ref = _joined(whole.pooler_output)
        ref_deep = [_joined(t) for t in getattr(whole, "deepstack_features", None) or []]
        for max_tokens in (1, 3, 20, 0):  # one temporal group per call, a few, several items per call, all at once
            _, feats, deep = encode_in_chunks(model, pixels, grid, "get_video_features", max_tokens)
            assert feats.shape == ref.shape
            assert float((feats - ref).abs().max()) <= ATOL, f"max_tokens {max_tokens}: features differ"
            assert len(deep or []) == len(ref_deep) == (2 if family == "qwen3_vl" else 0)
            for d, r in zip(deep or [], ref_deep):
                assert float((d - r).abs().max()) <= ATOL, f"max_tokens {max_tokens}: deepstack features differ"


@pytest.mark.parametrize("family, chunk", [("qwen2_5_vl", 24), ("qwen3_vl", 12)])
@pytest.mark.parametrize("decode", ["cascade", "copy"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunked_prefill_matches_one_forward(family, chunk, decode, sampling, load_tiny):
    model, processor = load_tiny(family)
    inputs = vl_batch(processor, family, VIDEOS)  # left padded, unequal lengths
    _boundaries_inside(model, inputs, chunk)
    assert len(chunk_spans(inputs["input_ids"].shape[1], chunk)) >= 4
    _compare(model, processor, inputs, SIZES, sampling, chunk, decode=decode)


@pytest.mark.parametrize("family", VL)
@pytest.mark.parametrize("chunk", [pytest.param(7, marks=pytest.mark.slow), 40])
def test_chunked_shared_prefill_matches_one_forward(family, chunk, load_tiny):
    """A video asked by several queries: its shared part prefilled once in chunks, each tail behind it."""
    model, processor = load_tiny(family)
    inputs = shared_batch(processor, PROMPTS)
    for sampling in (GREEDY, SEEDED):
        engine = HFEngine(model, processor, decode="cascade", prefill_chunk=chunk)
        ref = HFEngine(model, processor, decode="cascade").generate_groups(inputs, GROUPS, sampling)
        out = engine.generate_groups(inputs, GROUPS, sampling)
        assert engine.last_stats["shared_prompts"] == 4, engine.last_stats  # the shared path was taken
        assert torch.equal(out.completion_ids, ref.completion_ids)
        assert float((out.logprobs - ref.logprobs).abs().max()) <= ATOL


@pytest.mark.parametrize("decode", ["cascade", "copy"])
def test_chunked_prefill_with_the_models_own_attention(decode, load_tiny):
    """cascade_backend="math" (what "auto" takes off the CPU): the chunks run the model's own attention with the
    [B, 1, C, b] mask instead of chunk_attention; the same tokens and logprobs."""
    model, processor = load_tiny("qwen3_vl")
    inputs = vl_batch(processor, "qwen3_vl", VIDEOS)
    _compare(model, processor, inputs, SIZES, SEEDED, 12, decode=decode, cascade_backend="math")


def test_chunked_prefill_text_model(load_tiny):
    model, tokenizer = load_tiny("qwen2")
    inputs = text_batch(tokenizer, 3)
    for decode in ("cascade", "copy"):
        _compare(model, tokenizer, inputs, SIZES, SEEDED, 5, decode=decode)


@pytest.mark.parametrize("decode", ["cascade", "copy"])
def test_short_batch_takes_the_one_forward_path_bit_for_bit(decode, load_tiny, monkeypatch):
    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    ref = HFEngine(model, processor, decode=decode).generate_groups(inputs, SIZES, SEEDED)

    def refuse(*args, **kwargs):
        raise AssertionError("a batch shorter than one chunk was chunked")

    monkeypatch.setattr(HFEngine, "_prefill_chunks", refuse)
    out = HFEngine(model, processor, decode=decode, prefill_chunk=inputs["input_ids"].shape[1]).generate_groups(
        inputs, SIZES, SEEDED)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert torch.equal(out.logprobs, ref.logprobs)


def _needs_encoder_outputs(model) -> None:
    if not supports_encoder_outputs(model):
        pytest.skip("chunked prefill of a VL prompt needs mm_encoder_outputs (transformers >= 5.18)")


def test_synced_decoding_votes_once_per_prefill_forward(load_tiny):
    """Under synced decoding (ZeRO-3) the ranks first agree whether to chunk (one rank's long batch makes every
    rank take the chunked path, so all call the vision tower and the decoder in the same order), and a rank whose
    prefill took fewer chunks idles until every rank is done: each forward is followed by a vote before the next,
    and the tokens are those of an unsynced run."""
    model, processor = load_tiny("qwen2_5_vl")
    _needs_encoder_outputs(model)
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    log: list = []
    decoder = model.model.language_model
    hook = decoder.register_forward_hook(lambda m, args, out: log.append(("forward",)))
    try:
        synced = HFEngine(model, processor, all_done=_OtherRank(12, log), prefill_chunk=24).generate_groups(
            inputs, SIZES, GREEDY)
    finally:
        hook.remove()
    ref = HFEngine(model, processor, prefill_chunk=24).generate_groups(inputs, SIZES, GREEDY)
    assert torch.equal(synced.completion_ids, ref.completion_ids)
    # first every rank says whether it needs chunks (all ranks then take the same path: ZeRO-3 gathers weights
    # module by module), this rank does
    assert log[0] == ("all_done", False)
    log = log[1:]
    kinds = [e[0] for e in log]
    assert all(not (a == b == "forward") for a, b in zip(kinds, kinds[1:])), "two forwards without a vote between"
    chunks = len(chunk_spans(inputs["input_ids"].shape[1], 24))
    assert kinds.index("all_done") == 1 and log[2 * chunks - 1] == ("all_done", True)  # votes False until the last
    assert kinds[: 2 * chunks].count("forward") == chunks


def test_prefill_chunk_is_validated(load_tiny):
    from mmpg.config import load_config
    from mmpg.errors import UserError
    from mmpg.eval.settings import load_settings

    assert load_config().rollout.prefill_chunk == 8192
    with pytest.raises(UserError, match="prefill_chunk"):
        load_config(None, ["rollout.prefill_chunk=-1"])
    with pytest.raises(UserError, match="prefill_chunk"):
        load_settings("default", ["prefill_chunk=-2"])
    with pytest.raises(ValueError, match="prefill_chunk"):
        HFEngine(*load_tiny("qwen2"), prefill_chunk=-1)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_chunk_attention_against_a_dense_softmax(backend):
    """One chunk behind a past, GQA, left padding (a row still all padding, a row whose padding ends inside the
    chunk, a row without): real queries equal float64 causal softmax attention over the real keys."""
    from mmpg.rollout.cascade_attention import chunk_attention

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, past, C = 3, 4, 2, 16, 9, 6
    K = past + C
    q = torch.randn(B, Hq, C, D, generator=g)
    k, v = torch.randn(B, Hkv, K, D, generator=g), torch.randn(B, Hkv, K, D, generator=g)
    pads = [12, 4, 0]  # left padding of each row, in keys
    mask = torch.arange(K)[None, :] >= torch.tensor(pads)[:, None]  # [B, K]
    out = chunk_attention(q, k, v, mask, D ** -0.5, backend)  # [B, C, Hq, D]
    kk, vv = k.repeat_interleave(2, dim=1).double(), v.repeat_interleave(2, dim=1).double()
    s = q.double() @ kk.transpose(-1, -2) * D ** -0.5  # [B, Hq, C, K]
    allowed = mask[:, None, None, :] & (torch.arange(K)[None, :] <= past + torch.arange(C)[:, None])
    ref = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ vv  # NaN on all-padding queries
    real = mask[:, past:]  # [B, C] real queries
    got, want = out.transpose(1, 2).double(), ref
    assert torch.isfinite(out).all()
    assert float((got - want).abs().permute(0, 2, 1, 3)[real].max()) <= ATOL


@pytest.mark.slow
def test_prefill_bench_runs_and_chunking_lowers_the_peak():
    from mmpg.bench.prefill import table, whole_vs_chunked

    row = whole_vs_chunked(2048, 256, "qwen2_5_vl", "cpu")
    assert row["dlogp"] <= ATOL and "| 2" in table([row])


def test_a_short_batch_chunks_when_another_rank_must(load_tiny, monkeypatch):
    """Synced decoding: the other rank's batch is longer than a chunk (its vote says so), so this rank's short batch
    takes the chunked path too, in one chunk (vision tower first, then the decoder, in every rank's order)."""
    model, processor = load_tiny("qwen2_5_vl")
    _needs_encoder_outputs(model)
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    chunked = []
    real = HFEngine._prefill_chunks
    monkeypatch.setattr(HFEngine, "_prefill_chunks", lambda self, ids, *a: chunked.append(ids.shape[1]) or
                        real(self, ids, *a))
    votes = iter([False])  # the decision vote: not every rank can do without chunks; then every rank is done
    out = HFEngine(model, processor, all_done=lambda done: next(votes, done), prefill_chunk=10 ** 6).generate_groups(
        inputs, SIZES, GREEDY)
    ref = HFEngine(model, processor).generate_groups(inputs, SIZES, GREEDY)
    assert chunked == [inputs["input_ids"].shape[1]]
    assert torch.equal(out.completion_ids, ref.completion_ids)


def test_without_precomputed_features_a_long_prompt_is_prefilled_whole(load_tiny, monkeypatch, caplog):
    """transformers < 5.18 (no mm_encoder_outputs): one warning line, the one-forward prefill, the same tokens."""
    import mmpg.rollout.prefill as prefill

    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    monkeypatch.setattr(prefill, "supports_encoder_outputs", lambda model: False)
    monkeypatch.setattr(HFEngine, "_prefill_chunks", lambda *a: (_ for _ in ()).throw(AssertionError("chunked")))
    with caplog.at_level("WARNING", logger="mmpg.rollout"):
        out = HFEngine(model, processor, prefill_chunk=16).generate_groups(inputs, SIZES, GREEDY)
    assert sum("prefilled in one forward" in r.message for r in caplog.records) == 1
    assert torch.equal(out.completion_ids, HFEngine(model, processor).generate_groups(inputs, SIZES, GREEDY)
                       .completion_ids)
