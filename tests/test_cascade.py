"""Cascade (shared-prefix) decoding: the two-part attention against dense attention, the cache's bookkeeping, and
`HFEngine(decode="cascade")` against the copy path and per-prompt `model.generate` on tiny float32 models.

Dense reference for row i of prompt b at own length t + 1: softmax over [prefix_b without its padding | own_i[:t+1]]
with GQA query head h on kv head h // rep, computed in float64."""

from __future__ import annotations

import pytest
import torch

from batches import assert_recompute_matches, text_batch, vl_batch
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout.cascade import SharedPrefixCache
from mmpg.rollout.cascade_attention import PREFIX, decode_attention
from mmpg.rollout.cascade_kernels import attend, resolve_cascade_kernel

VL = ["qwen2_5_vl", "qwen3_vl"]
VIDEOS = [(4, 56, 84), None, (6, 56, 112)]  # two videos of different sizes and a text-only prompt
SIZES = [2, 1, 3]
LOGP_ATOL = 1e-4


# ---- the attention itself ------------------------------------------------------------------------------------------
def _filled_cache(prefix_lens, row_prompt, own_len, hkv=2, d=16, dtype=torch.float32, seed=0):
    """A SharedPrefixCache of one layer as the engine leaves it: B left-padded prefixes, rows [n], own_len tokens."""
    g = torch.Generator().manual_seed(seed)
    B, L, n = len(prefix_lens), max(prefix_lens), len(row_prompt)
    cache = SharedPrefixCache(num_layers=1, capacity=own_len + 2)
    mask = torch.arange(L)[None, :] >= (L - torch.tensor(prefix_lens))[:, None]  # [B, L] left padding
    cache.update(torch.randn(B, hkv, L, d, generator=g, dtype=dtype),
                 torch.randn(B, hkv, L, d, generator=g, dtype=dtype), 0)
    cache.start_decode(torch.tensor(row_prompt), mask)
    for _ in range(own_len):
        k, v = cache.update(torch.randn(n, hkv, 1, d, generator=g, dtype=dtype),
                            torch.randn(n, hkv, 1, d, generator=g, dtype=dtype), 0)
    return cache, mask, k, v


def _dense(query, full_mask, prefix_k, prefix_v, own_k, own_v, row_prompt, scale):
    """[n, Hq, 1, D] -> [n, 1, Hq, D] in float64, one row at a time."""
    hq = query.shape[1]
    rep = hq // own_k.shape[1]
    out = []
    for i, b in enumerate(row_prompt):
        keep = full_mask[b]
        k = torch.cat([prefix_k[b][:, keep], own_k[i]], dim=1).double().repeat_interleave(rep, 0)  # [Hq, K, D]
        v = torch.cat([prefix_v[b][:, keep], own_v[i]], dim=1).double().repeat_interleave(rep, 0)
        p = torch.softmax(query[i].double() @ k.transpose(1, 2) * scale, dim=-1)  # [Hq, 1, K]
        out.append((p @ v).transpose(0, 1))  # [1, Hq, D]
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("row_prompt", [[0, 0, 1, 2, 2, 2], [0, 0, 0, 0]], ids=["unequal", "one_prompt"])
def test_decode_attention_equals_dense(backend, row_prompt):
    prefix_lens = [7, 3, 11][: max(row_prompt) + 1]
    cache, mask, own_k, own_v = _filled_cache(prefix_lens, row_prompt, own_len=5)
    layer = cache.layers[0]
    query = torch.randn(len(row_prompt), 4, 1, 16, generator=torch.Generator().manual_seed(1))  # GQA: 4 q / 2 kv
    got = decode_attention(query, own_k, own_v, layer.prefix_keys, layer.prefix_values, cache, 0.25, backend)
    ref = _dense(query, mask, layer.prefix_keys, layer.prefix_values, own_k, own_v, row_prompt, 0.25)
    assert got.shape == (len(row_prompt), 1, 4, 16)
    assert float((got.double() - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_a_later_turn_attends_to_prefix_history_and_its_chunk(backend):
    """Multi-turn bookkeeping (`keep_branches`, `retire_live`, `begin_turn`): three rows of two prompts; row 1 ends
    its first turn before feeding a token (an empty history), rows 0 and 2 feed 4. Rows 1 and 2 go on: their tool
    turns as one left-padded chunk (row 1's 2 tokens, row 2's 3), then one decode step. Each against dense attention
    over [prefix without padding | the row's kept keys | its chunk's real keys so far (causal) | its new token]."""
    g = torch.Generator().manual_seed(3)
    hkv, d, scale = 2, 16, 0.25
    row_prompt = [0, 0, 1]
    cache = SharedPrefixCache(num_layers=1, capacity=4)
    mask = torch.tensor([[True] * 7, [False] * 4 + [True] * 3])  # [B, L] left padding
    cache.update(torch.randn(2, hkv, 7, d, generator=g), torch.randn(2, hkv, 7, d, generator=g), 0)
    cache.start_decode(torch.tensor(row_prompt), mask)
    cache.keep_branches()
    layer = cache.layers[0]
    fed = {0: [], 1: [], 2: []}  # each row's keys and values, in order

    def feed(rows, c=1):
        k, v = torch.randn(len(rows), hkv, c, d, generator=g), torch.randn(len(rows), hkv, c, d, generator=g)
        for j, r in enumerate(rows):
            fed[r].append((k[j], v[j]))
        return cache.update(k, v, 0)

    cache.reorder_cache(torch.tensor([0, 2]))  # row 1 leaves with nothing fed
    for _ in range(4):
        feed([0, 2])
    cache.retire_live()
    assert sorted(cache.branches) == [0, 1, 2] and cache.branches[1][0][0].shape == (hkv, 0, d)
    chunk_mask = torch.tensor([[False, True, True], [True, True, True]])
    cache.begin_turn(torch.tensor([1, 2]), torch.tensor([0, 1]), chunk_mask, capacity=4)
    assert sorted(cache.branches) == [] and cache.history_mask.tolist() == [[False] * 4, [True] * 4]  # row 1: none

    def dense(query, rows, own_real, causal):
        out = []
        for j, r in enumerate(rows):
            b = row_prompt[r]
            keys = [layer.prefilled[0][0][b][:, mask[b]], *[k[:, own_real[j][i]] for i, (k, _) in enumerate(fed[r])]]
            vals = [layer.prefilled[1][0][b][:, mask[b]], *[v[:, own_real[j][i]] for i, (_, v) in enumerate(fed[r])]]
            k, v = torch.cat(keys, 1).double(), torch.cat(vals, 1).double()
            rows_out = []
            for q_pos in range(query.shape[2]):
                kk, vv = (k[:, : k.shape[1] - causal[j][q_pos]], v[:, : v.shape[1] - causal[j][q_pos]])
                p = torch.softmax(query[j][:, q_pos: q_pos + 1].double() @ kk.repeat_interleave(2, 0).transpose(1, 2)
                                  * scale, dim=-1)
                rows_out.append((p @ vv.repeat_interleave(2, 0)).transpose(0, 1))  # [1, Hq, D]
            out.append(torch.cat(rows_out))
        return torch.stack(out)  # [n, C, Hq, D]

    # the chunk: row 1's first position is padding; query l sees the chunk's real keys <= l
    own_k, own_v = feed([1, 2], c=3)
    query = torch.randn(2, 4, 3, d, generator=g)
    got = decode_attention(query, own_k, own_v, layer.prefix_keys, layer.prefix_values, cache, scale, backend,
                           history_k=layer.history_keys, history_v=layer.history_values)
    real = [[chunk_mask[0]], [slice(None)] * 4 + [chunk_mask[1]]]  # per fed piece, its real keys
    later = [[2, 1, 0], [2, 1, 0]]  # chunk keys after query l, not seen
    ref = dense(query, [1, 2], real, later)
    assert float((got[0, 1:].double() - ref[0, 1:]).abs().max()) < 1e-5  # row 1's padding query is never read
    assert float((got[1].double() - ref[1]).abs().max()) < 1e-5
    # a decode step behind the chunk
    own_k, own_v = feed([1, 2])
    query = torch.randn(2, 4, 1, d, generator=g)
    got = decode_attention(query, own_k, own_v, layer.prefix_keys, layer.prefix_values, cache, scale, backend,
                           history_k=layer.history_keys, history_v=layer.history_values)
    ref = dense(query, [1, 2], [real[0] + [slice(None)], real[1] + [slice(None)]], [[0], [0]])
    assert float((got.double() - ref).abs().max()) < 1e-5


def _kvcache_standin(q, k_cache, v_cache, cache_seqlens=None, cache_leftpad=None, softmax_scale=None, causal=False,
                     return_softmax_lse=False):
    """flash-attn's `flash_attn_with_kvcache` as its docstring states it, in plain torch: [B, L, H, D] layouts, keys
    [cache_leftpad_b, cache_seqlens_b) of row b attended, returns (out [B, Lq, H, D], lse [B, H, Lq] float32)."""
    assert not causal and return_softmax_lse and cache_seqlens.dtype == torch.int32 and k_cache.stride(-1) == 1
    pos = torch.arange(k_cache.shape[1])[None, :]
    lo = torch.zeros_like(cache_seqlens) if cache_leftpad is None else cache_leftpad
    keep = (pos >= lo[:, None].long()) & (pos < cache_seqlens[:, None].long())  # [B, Lk]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k_cache.float()) * softmax_scale
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v_cache.float())
    return out.to(q.dtype), lse


def test_flash_call_site_with_a_standin(monkeypatch):
    """The `flash` kernel's layouts and left padding, on the CPU through a stand-in `flash_attn_with_kvcache`
    (the CUDA kernel itself: tests/test_cascade_gpu.py)."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_with_kvcache=_kvcache_standin))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, n, 16, generator=g) for n in (6, 20, 20))
    mask = torch.arange(20)[None, :] >= torch.tensor([0, 5, 19])[:, None]
    for key_mask in (None, mask):
        out, lse = attend(q, k, v, key_mask, 0.25, "flash")
        ref, ref_lse = attend(q, k, v, key_mask, 0.25, "math")
        assert float((out - ref).abs().max()) < 1e-5 and float((lse - ref_lse).abs().max()) < 1e-5


def test_auto_backend_is_torchs_kernel():
    """The per-run chain with its check (flash first on CUDA) is tests/test_decode_choice.py."""
    assert resolve_cascade_kernel("auto", torch.device("cpu")) == "sdpa"
    assert resolve_cascade_kernel("auto", torch.device("cuda", 0)) == "sdpa"
    assert resolve_cascade_kernel("flash", torch.device("cuda", 0)) == "flash"


def test_rows_and_prompts_leave_the_cache():
    """Rows leave by reorder_cache; a prompt whose rows all finished leaves the prefix batch; the attention of the
    remaining rows is unchanged."""
    row_prompt = [0, 0, 1, 2, 2, 2]
    cache, _, own_k, own_v = _filled_cache([7, 3, 11], row_prompt, own_len=4)
    query = torch.randn(6, 4, 1, 16, generator=torch.Generator().manual_seed(2))
    layer = cache.layers[0]
    before = decode_attention(query, own_k, own_v, layer.prefix_keys, layer.prefix_values, cache, 0.25, "sdpa")
    full = cache.kv_bytes()
    keep = torch.tensor([0, 3, 5])  # prompt 1 loses its only row, prompts 0 and 2 keep one and two rows
    cache.reorder_cache(keep)
    assert layer.prefix_keys.shape[0] == 2 and cache.prefix_mask.shape[0] == 2
    assert cache.rows.row_prompt.tolist() == [0, 1, 1] and not cache.rows.equal
    assert cache.kv_bytes() < full
    after = decode_attention(query[keep], layer.own_keys[:, :, :4], layer.own_values[:, :, :4], layer.prefix_keys,
                             layer.prefix_values, cache, 0.25, "sdpa")
    assert float((after - before[keep]).abs().max()) < 1e-6


def test_kv_bytes_follow_the_token_ratio():
    """One prompt of P tokens, G rows of S tokens: the cascade cache holds P + G·S tokens' K/V, the copy G·(P + S)."""
    P, G, S, hkv, d = 40, 4, 6, 2, 8
    cache = SharedPrefixCache(num_layers=2, capacity=S)
    for layer in range(2):
        cache.update(torch.zeros(1, hkv, P, d), torch.zeros(1, hkv, P, d), layer)
    cache.start_decode(torch.zeros(G, dtype=torch.long), torch.ones(1, P, dtype=torch.bool))
    for layer in range(2):
        cache.update(torch.zeros(G, hkv, 1, d), torch.zeros(G, hkv, 1, d), layer)
    assert cache.kv_bytes() == 2 * 2 * hkv * d * 4 * (P + G * S)
    assert cache.prefix_mask is None  # no padding: no key mask at all


def test_cache_misuse_is_refused():
    cache = SharedPrefixCache(num_layers=1, capacity=1)
    with pytest.raises(RuntimeError, match="start_decode before the prefill"):
        cache.start_decode(torch.zeros(2, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    cache.start_decode(torch.zeros(2, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))
    cache.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), 0)
    with pytest.raises(RuntimeError, match="capacity 1 exceeded"):
        cache.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), 0)


# ---- the engine: cascade == copy == generate -----------------------------------------------------------------------
def _batch(family, processor, padding_side="left"):
    if family in VL:
        return vl_batch(processor, family, VIDEOS, padding_side)
    return text_batch(processor, 3, padding_side)


def _generate_alone(model, inputs, b, steps, stop_id):
    from test_rollout import _generate_reference

    ref = _generate_reference(model, inputs, b, steps, stop_id)
    return ref[: ref.index(stop_id) + 1] if stop_id in ref else ref


@pytest.mark.parametrize("family", VL + ["qwen2"])
def test_greedy_cascade_equals_copy_and_generate(family, load_tiny):
    """Unequal groups, both padding sides, a stop token some rows emit mid-way (rows and whole prompts leave early):
    token-identical to the copy path and to `generate` on each prompt alone; logprobs equal the copy path's."""
    model, processor = load_tiny(family)
    steps = 10
    copy, cascade = HFEngine(model, processor, decode="copy"), HFEngine(model, processor, decode="cascade")
    free = copy.generate_groups(_batch(family, processor), 1,
                                SamplingParams(max_new_tokens=steps, temperature=0, stop_token_ids=()))
    stop_id = int(free.completion_ids[0, 4])
    greedy = SamplingParams(max_new_tokens=steps, temperature=0, stop_token_ids=(stop_id,))
    for side in ("left", "right"):
        inputs = _batch(family, processor, side)
        a, b = copy.generate_groups(inputs, SIZES, greedy), cascade.generate_groups(inputs, SIZES, greedy)
        assert torch.equal(a.completion_ids, b.completion_ids), f"{side}: cascade != copy"
        assert a.finish_reasons == b.finish_reasons and set(b.finish_reasons) == {"stop", "length"}
        assert float((a.logprobs - b.logprobs).abs().max()) < 1e-5
    for i, p in enumerate(b.prompt_index.tolist()):
        got = b.completion_ids[i, : b.lengths[i]].tolist()
        assert got == _generate_alone(model, inputs, p, steps, stop_id), f"row {i} (prompt {p}) != generate"


@pytest.mark.parametrize("family", VL)
def test_sampled_cascade_equals_copy(family, load_tiny):
    """Seeded sampling (one generator, then per-prompt seeds) with top-k / top-p and a stop token: the cascade path
    draws exactly the copy path's tokens; its logprobs equal `grouped_logprobs` within 1e-4."""
    model, processor = load_tiny(family)
    inputs = _batch(family, processor)
    copy, cascade = HFEngine(model, processor, decode="copy"), HFEngine(model, processor, decode="cascade")
    free = {"max_new_tokens": 8, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "seed": 4}
    for seeds in (None, [11, 22, 33]):
        stops = tuple(set(copy.generate_groups(inputs, SIZES, SamplingParams(**free, stop_token_ids=()),
                                               prompt_seeds=seeds).completion_ids[:3, 3].tolist()))  # rows 0-2 stop
        sampling = SamplingParams(**free, stop_token_ids=stops)
        a = copy.generate_groups(inputs, SIZES, sampling, prompt_seeds=seeds)
        b = cascade.generate_groups(inputs, SIZES, sampling, prompt_seeds=seeds)
        assert torch.equal(a.completion_ids, b.completion_ids), f"prompt_seeds={seeds}: cascade != copy"
        assert a.finish_reasons == b.finish_reasons and min(b.lengths) < max(b.lengths)
        assert_recompute_matches(model, inputs, b, sampling.temperature, LOGP_ATOL)


def test_synced_cascade_decoding_idles_like_copy(load_tiny):
    """ZeRO-3 lockstep: with an all_done that agrees only later, the cascade path runs idle forwards and returns
    the same rollout as alone."""
    model, processor = load_tiny("qwen2_5_vl")
    inputs = _batch("qwen2_5_vl", processor)
    greedy = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())
    calls = []

    def all_done(done):
        calls.append(done)
        return len(calls) >= 6

    short = SamplingParams(max_new_tokens=6, temperature=0,
                           stop_token_ids=tuple(set(HFEngine(model, processor, decode="copy").generate_groups(
                               inputs, SIZES, greedy).completion_ids[:, 1].tolist())))
    alone = HFEngine(model, processor, decode="cascade").generate_groups(inputs, SIZES, short, prompt_seeds=[1, 2, 3])
    synced = HFEngine(model, processor, all_done=all_done, decode="cascade").generate_groups(
        inputs, SIZES, short, prompt_seeds=[1, 2, 3])
    assert max(alone.lengths) <= 2 and len(calls) == 6 and calls[-1]
    assert torch.equal(alone.completion_ids, synced.completion_ids)


def test_attention_restored_and_grouped_model_works(load_tiny):
    """The text model's attention implementation is ours only during the decode loop (also after an error); a model
    patched for the grouped forward decodes the same and still computes grouped logprobs."""
    from mmpg.grouping import apply_grouped_attention

    model, processor = load_tiny("qwen3_vl")
    inputs = _batch("qwen3_vl", processor)
    text = model.config.get_text_config()
    before = text._attn_implementation
    greedy = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=())
    plain = HFEngine(model, processor, decode="cascade").generate_groups(inputs, SIZES, greedy)
    assert text._attn_implementation == before
    apply_grouped_attention(model)
    grouped_name = text._attn_implementation
    engine = HFEngine(model, processor, decode="cascade")
    again = engine.generate_groups(inputs, SIZES, greedy)
    assert torch.equal(plain.completion_ids, again.completion_ids) and text._attn_implementation == grouped_name
    assert_recompute_matches(model, inputs, again, 1.0, LOGP_ATOL)
    engine._cascade_step = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate_groups(inputs, SIZES, greedy)
    assert text._attn_implementation == grouped_name and not grouped_name.startswith(PREFIX)


def test_bad_decode_mode_and_backend(load_tiny):
    model, tokenizer = load_tiny("qwen2")
    with pytest.raises(ValueError, match="decode='paged'"):
        HFEngine(model, tokenizer, decode="paged")
    with pytest.raises(ValueError, match="unknown cascade attention backend 'xla'"):
        HFEngine(model, tokenizer, decode="cascade", cascade_backend="xla")


def test_cascade_is_the_default():
    from mmpg.config import Config
    from mmpg.rollout.hf import resolve_decode

    assert Config().rollout.decode == "auto" and HFEngine.__init__.__defaults__[1] == "auto"
    assert resolve_decode("auto") == "cascade"  # on every device (on CUDA its kernel is checked against copy first)
    assert resolve_decode("copy") == "copy"
