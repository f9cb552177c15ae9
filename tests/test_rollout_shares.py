"""A video shared by its queries in the rollout engine (`mmpg.rollout.shares`, the shared levels of
`mmpg.rollout.cascade`): adjacent prompts with the same video are prefilled as one packed row (shared part once,
each query's tail behind it) and decoded with three cascade levels (shared part | tail | own tokens).

Against the per-query engine — decode="copy", and decode="cascade" on the same prompts permuted so that no two
adjacent prompts share — on tiny float32 Qwen2.5-VL and Qwen3-VL: greedy and seeded sampling token for token, for
videos asked by 1, 2 and 4 queries, tails of unequal length, unequal group sizes, shared and unshared prompts mixed,
a stop token some rows emit mid-way; logprobs within 1e-4 of `grouped_logprobs` at temperature 1; the vision tower
encodes each distinct video once; `last_stats` counted by hand; two different videos under identical text never
share; synced (ZeRO-3) decoding idles as without shares. The three-level attention itself against a dense float64
softmax, also after rows, whole queries and whole shares have left the cache."""

from __future__ import annotations

import pytest
import torch

from batches import assert_recompute_matches, text_batch, vl_batch
from test_grouping_shares import GROUPS, PROMPTS, shared_batch
from test_rollout_seeds import _OtherRank
from mmpg.grouping import grouped_logprobs
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout.cascade import SharedPrefixCache, ShareSplit
from mmpg.rollout.cascade_attention import decode_attention

VL = ["qwen2_5_vl", "qwen3_vl"]
# PROMPTS (test_grouping_shares): video a asked 4 times, b once, c twice, a text prompt, c2 (c's size and question,
# other frames). PERM puts them in an order where no two neighbours have the same video: the per-query reference.
PERM = [0, 5, 1, 4, 2, 6, 3, 7, 8]
SEEDS = [5, 17, 23, 31, 42, 57, 61, 77, 89]
LOGP_ATOL = 1e-4  # |rollout logprob - grouped_logprobs recompute|, float32, as tests/test_rollout.py


def _rows(rollout, b: int) -> list[list[int]]:
    """The token ids of prompt b's responses, each cut at its length."""
    return [rollout.completion_ids[i, :n].tolist()
            for i, (p, n) in enumerate(zip(rollout.prompt_index.tolist(), rollout.lengths)) if p == b]


def _lengths(inputs) -> list[int]:
    return inputs["attention_mask"].sum(dim=1).tolist()


def _shared_tokens_by_hand(inputs, prompts) -> int:
    """Prompt tokens a shared prefill holds: every prompt, less (Q - 1) * L per run of Q adjacent prompts of one video
    that agree on their first L token ids (L = the longest common leading part, every tail >= 1 token)."""
    ids = [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    total, b = sum(len(r) for r in ids), 0
    while b < len(prompts):
        e = b
        while e + 1 < len(prompts) and prompts[e + 1][0] is not None and prompts[e + 1][0] == prompts[b][0]:
            e += 1
        run = ids[b:e + 1]
        common = min(len(r) for r in run) - 1
        for r in run[1:]:
            common = min(common, next((i for i, (x, y) in enumerate(zip(run[0], r)) if x != y), common))
        total -= (len(run) - 1) * common
        b = e + 1
    return total


def _three_ways(model, processor, sampling, prompts=PROMPTS, groups=GROUPS, seeds=None, perm=PERM):
    """(shared cascade, copy, per-query cascade (share_videos off) on the batch permuted by `perm`) rollouts and the
    engines' last_stats."""
    inputs = shared_batch(processor, prompts)
    cascade, copy = HFEngine(model, processor, decode="cascade"), HFEngine(model, processor, decode="copy")
    shared = cascade.generate_groups(inputs, groups, sampling, prompt_seeds=seeds)
    shared_stats = cascade.last_stats
    ref = copy.generate_groups(inputs, groups, sampling, prompt_seeds=seeds)
    alone = HFEngine(model, processor, decode="cascade", share_videos=False)  # per query (a video apart is shared)
    permuted = alone.generate_groups(shared_batch(processor, [prompts[p] for p in perm]), [groups[p] for p in perm],
                                     sampling, prompt_seeds=None if seeds is None else [seeds[p] for p in perm])
    assert alone.last_stats["shared_prompts"] == 0, f"the per-query batch must not share: {alone.last_stats}"
    return inputs, shared, shared_stats, ref, copy.last_stats, permuted, perm


def _assert_same_per_prompt(shared, ref, permuted, perm, what: str) -> None:
    for b in range(len(perm)):
        assert _rows(shared, b) == _rows(ref, b), f"{what}: prompt {b} shared != copy"
        assert _rows(shared, b) == _rows(permuted, perm.index(b)), f"{what}: prompt {b} shared != per-query cascade"


# ---- greedy and sampled, token for token ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", VL)
def test_greedy_shared_equals_per_query(family, load_tiny):
    """Shares (0-3), (5, 6) among lone prompts; a stop token row 0 emits early and some row never emits, so rows,
    whole queries and whole shares leave the cache early while others run to the length. The counters: 5 prefills
    for 9 prompts, the tokens counted by hand."""
    model, processor = load_tiny(family)
    steps = 8
    free = HFEngine(model, processor, decode="copy").generate_groups(
        shared_batch(processor, PROMPTS), GROUPS,
        SamplingParams(max_new_tokens=steps, temperature=0, stop_token_ids=()))
    rows = free.completion_ids.tolist()
    # row 0's earliest token (from its 2nd) that first occurs there and that some row never emits: a tiny random
    # model's greedy rows repeat tokens, and which ones depends on the transformers release that built it
    stop_id = next((t for i, t in enumerate(rows[0][1:steps - 1], 1) if t not in rows[0][:i]
                    and any(t not in row[:steps] for row in rows)), None)
    assert stop_id is not None, f"no token of row 0 stops it early and leaves another row running: {rows}"
    greedy = SamplingParams(max_new_tokens=steps, temperature=0, stop_token_ids=(stop_id,))
    inputs, shared, stats, ref, copy_stats, permuted, perm = _three_ways(model, processor, greedy)
    _assert_same_per_prompt(shared, ref, permuted, perm, "greedy")
    assert shared.finish_reasons == ref.finish_reasons and set(shared.finish_reasons) == {"stop", "length"}
    diff = float((shared.logprobs - ref.logprobs).abs().max())
    assert diff < 1e-5, f"greedy logprobs shared vs copy differ by {diff:.3g}"
    lengths = _lengths(inputs)
    assert stats == {"prompts": 9, "prefixes": 5, "prefix_tokens": _shared_tokens_by_hand(inputs, PROMPTS),
                     "shared_prompts": 4}
    assert stats["prefix_tokens"] < sum(lengths)
    assert copy_stats == {"prompts": 9, "prefixes": 9, "prefix_tokens": sum(lengths), "shared_prompts": 0}
    print(f"{family}: greedy shared == copy == per-query; logprob diff {diff:.3g}; {stats}")


@pytest.mark.parametrize("family", VL)
def test_sampled_shared_equals_per_query_and_recompute(family, load_tiny):
    """Per-prompt seeds (top-k, top-p, temperature 1): the same tokens as per query, and logprobs within 1e-4 of
    `grouped_logprobs`; one batch generator: the same tokens as the copy path (rows are drawn in the same order)."""
    model, processor = load_tiny(family)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.95, seed=3, stop_token_ids=())
    inputs, shared, _, ref, _, permuted, perm = _three_ways(model, processor, sampling, seeds=SEEDS)
    _assert_same_per_prompt(shared, ref, permuted, perm, "prompt_seeds")
    assert_recompute_matches(model, inputs, shared, 1.0, LOGP_ATOL)
    with torch.no_grad():
        grouped = grouped_logprobs(model, inputs, shared.completion_ids, shared.completion_mask, GROUPS)
    one = HFEngine(model, processor, decode="cascade").generate_groups(inputs, GROUPS, sampling)
    assert torch.equal(one.completion_ids, HFEngine(model, processor, decode="copy").generate_groups(
        inputs, GROUPS, sampling).completion_ids)
    assert not torch.equal(shared.completion_ids[0], shared.completion_ids[1])  # rows drawn independently
    to_grouped, to_copy = (float((shared.logprobs - x).abs().max()) for x in (grouped, ref.logprobs))
    print(f"{family}: seeded shared == copy == per-query; logprob diff vs grouped_logprobs {to_grouped:.3g}, "
          f"vs copy {to_copy:.3g}")


# ---- what is computed once ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", VL)
def test_vision_tower_once_per_video(family, load_tiny):
    """Videos encoded = rows of the video_grid_thw the vision tower receives: 4 distinct videos (a, b, c, c2) for
    8 prompts with video; the copy path, per query, encodes all 8."""
    model, processor = load_tiny(family)
    inputs = shared_batch(processor, PROMPTS)
    seen = []

    def hook(module, args, kwargs, out):
        grid = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
        seen.append(int(grid.shape[0]))

    handle = model.model.visual.register_forward_hook(hook, with_kwargs=True)
    sampling = SamplingParams(max_new_tokens=3, stop_token_ids=())
    try:
        engine = HFEngine(model, processor, decode="cascade")
        engine.generate_groups(inputs, GROUPS, sampling)
        assert sum(seen) == 4, f"videos encoded per call: {seen}"
        assert engine.last_stats["prefix_tokens"] == _shared_tokens_by_hand(inputs, PROMPTS)
        seen.clear()
        HFEngine(model, processor, decode="copy").generate_groups(inputs, GROUPS, sampling)
        assert sum(seen) == 8, f"videos encoded per call: {seen}"
    finally:
        handle.remove()


@pytest.mark.parametrize("family", VL)
def test_identical_text_different_videos_never_share(family, load_tiny):
    """c and c2 have the same size and text but other frames: not shared; c2 asked twice (the same prompt, so the
    tail is its last token): shared; so is c, asked first and last (a video apart in the batch is brought side by
    side, `mmpg.grouping.shares.share_order`)."""
    model, processor = load_tiny(family)
    prompts, groups = [("c", 2), ("c2", 2), ("c2", 2), ("c", 2)], [2, 1, 3, 2]
    greedy = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=())
    inputs, shared, stats, ref, _, permuted, perm = _three_ways(model, processor, greedy, prompts, groups,
                                                                perm=[1, 0, 2, 3])
    lengths = _lengths(inputs)
    assert stats == {"prompts": 4, "prefixes": 2, "prefix_tokens": sum(lengths) - (lengths[1] - 1) - (lengths[0] - 1),
                     "shared_prompts": 2}
    _assert_same_per_prompt(shared, ref, permuted, perm, "c / c2")
    other = HFEngine(model, processor, decode="cascade")
    other.generate_groups(shared_batch(processor, [("c", 2), ("c2", 2), ("c", 2)]), 2, greedy)
    assert other.last_stats["prefixes"] == 2 and other.last_stats["shared_prompts"] == 1


def test_batches_without_repeats_take_the_plain_path(load_tiny, monkeypatch):
    """Different videos, or text prompts that share only a short chat header: no sharing (today's path)."""
    import mmpg.rollout.hf as hf

    monkeypatch.setattr(hf, "shared_prefill",
                        lambda *a, **k: pytest.fail("a batch without repeats built a shared prefill"))
    model, processor = load_tiny("qwen2_5_vl")
    engine = HFEngine(model, processor, decode="cascade")
    inputs = vl_batch(processor, "qwen2_5_vl", [(4, 56, 84), None, (6, 56, 112)])
    engine.generate_groups(inputs, [2, 1, 3], SamplingParams(max_new_tokens=3))
    assert engine.last_stats == {"prompts": 3, "prefixes": 3, "prefix_tokens": sum(_lengths(inputs)),
                                 "shared_prompts": 0}
    model, tokenizer = load_tiny("qwen3")
    engine = HFEngine(model, tokenizer, decode="cascade")
    engine.generate_groups(text_batch(tokenizer, 3), 2, SamplingParams(max_new_tokens=3))
    assert engine.last_stats["prefixes"] == 3 and engine.last_stats["shared_prompts"] == 0


def test_text_prompts_share_a_long_system_text(load_tiny):
    """A text model: two questions behind the same long system text (>= MIN_TEXT_SHARED tokens) share it; greedy
    decoding equals the copy path (1-D positions)."""
    from mmpg.rollout.shares import MIN_TEXT_SHARED

    model, tokenizer = load_tiny("qwen2")
    system = "You locate moments in videos and answer with start and end seconds. " * 4
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           tokenize=False, add_generation_prompt=True)
             for q in ("When is it?", "Find the moment the blue square moves to the left side of the frame.")]
    inputs = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    greedy = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())
    engine = HFEngine(model, tokenizer, decode="cascade")
    shared = engine.generate_groups(inputs, [2, 3], greedy)
    assert engine.last_stats["prefixes"] == 1 and engine.last_stats["shared_prompts"] == 1
    assert sum(_lengths(inputs)) - engine.last_stats["prefix_tokens"] >= MIN_TEXT_SHARED
    ref = HFEngine(model, tokenizer, decode="copy").generate_groups(inputs, [2, 3], greedy)
    assert torch.equal(shared.completion_ids, ref.completion_ids)


# ---- synced decoding -------------------------------------------------------------------------------------------------
def test_synced_decoding_with_shares(load_tiny):
    """ZeRO-3 lockstep with shares: the shared prefill is one forward (as the plain one), then one decode step per
    call; after this rank's rows are done, one-token idle forwards until the simulated other rank is."""
    model, processor = load_tiny("qwen2_5_vl")
    inputs = shared_batch(processor, PROMPTS)
    decoder = model.model.language_model
    free = HFEngine(model, processor).generate_groups(inputs, GROUPS, SamplingParams(max_new_tokens=8,
                                                      stop_token_ids=()), prompt_seeds=SEEDS)
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=tuple(set(free.completion_ids[:, 2].tolist())))

    def run(all_done, log):
        hook = decoder.register_forward_hook(lambda m, a, out: log.append(("forward", *out.last_hidden_state.shape)))
        try:
            engine = HFEngine(model, processor, all_done=all_done)
            return engine.generate_groups(inputs, GROUPS, sampling, prompt_seeds=SEEDS), engine.last_stats
        finally:
            hook.remove()

    log: list = []
    alone, stats = run(None, log)
    local = max(alone.lengths)
    assert stats["shared_prompts"] == 4 and local <= 3 and len(log) == local  # one prefill + local - 1 steps
    assert log[0][1] == 1 and log[0][2] == stats["prefix_tokens"]  # the prefill: one packed row of the shared prefill
    log = []
    synced, _ = run(_OtherRank(local + 3, log), log)
    assert torch.equal(synced.completion_ids, alone.completion_ids) and torch.equal(synced.logprobs, alone.logprobs)
    forwards = [e for e in log if e[0] == "forward"]
    assert len(forwards) == local + 3 and all(e[1:3] == (1, 1) for e in forwards[local:])  # 3 idle forwards


# ---- the three-level attention ---------------------------------------------------------------------------------------
def _shared_cache(shared_lens, tail_lens, query_share, row_query, own_len, hkv=2, d=16, seed=0):
    """One layer filled as a packed shared prefill leaves it, decoded `own_len` steps. Returns the cache, the packed
    K/V [1, Hkv, T, D], each query's packed key positions, and the own K/V."""
    g = torch.Generator().manual_seed(seed)
    spans, queries, at = [], [], 0
    for s, n in enumerate(shared_lens):
        spans.append((at, n))
        base, at = at, at + n
        for q in [q for q, owner in enumerate(query_share) if owner == s]:
            queries.append(list(range(base, base + n)) + list(range(at, at + tail_lens[q])))
            at += tail_lens[q]
    tails = [(qs[-1] - tail_lens[q] + 1, tail_lens[q]) for q, qs in enumerate(queries)]

    def left_padded(entries):
        width = max(n for _, n in entries)
        pad = torch.tensor([width - n for _, n in entries])[:, None]
        offs = torch.arange(width)[None, :]
        return torch.tensor([a for a, _ in entries])[:, None] + (offs - pad).clamp(min=0), offs >= pad

    packed_k, packed_v = (torch.randn(1, hkv, at, d, generator=g) for _ in range(2))
    split = ShareSplit(*left_padded(spans), *left_padded(tails), torch.tensor(query_share))
    cache = SharedPrefixCache(num_layers=1, capacity=own_len + 1)
    cache.expect_shares(split)
    cache.update(packed_k, packed_v, 0)
    cache.start_decode(torch.tensor(row_query))
    for _ in range(own_len):
        own_k, own_v = cache.update(*(torch.randn(len(row_query), hkv, 1, d, generator=g) for _ in range(2)), 0)
    return cache, packed_k, packed_v, queries, own_k, own_v


def _dense_shared(query, packed_k, packed_v, keys_of_row, own_k, own_v, scale):
    """[n, Hq, 1, D] -> [n, 1, Hq, D] float64: softmax over [row's shared part and tail | own tokens]."""
    rep = query.shape[1] // own_k.shape[1]
    out = []
    for i, keys in enumerate(keys_of_row):
        k = torch.cat([packed_k[0][:, keys], own_k[i]], dim=1).double().repeat_interleave(rep, 0)
        v = torch.cat([packed_v[0][:, keys], own_v[i]], dim=1).double().repeat_interleave(rep, 0)
        out.append((torch.softmax(query[i].double() @ k.transpose(1, 2) * scale, dim=-1) @ v).transpose(0, 1))
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_three_level_attention_equals_dense(backend):
    """Shares of 3, 1 and 2 queries, shared parts 9 / 4 / 13 tokens, ragged tails 1-5, unequal rows per query; then
    rows leave so that query 3 (share 1's only one) and all of share 2 are gone."""
    shared_lens, tail_lens, query_share = [9, 4, 13], [3, 5, 1, 2, 4, 1], [0, 0, 0, 1, 2, 2]
    row_query = [0, 0, 1, 2, 2, 2, 3, 4, 4, 5]
    cache, pk, pv, queries, own_k, own_v = _shared_cache(shared_lens, tail_lens, query_share, row_query, own_len=3)
    query = torch.randn(len(row_query), 4, 1, 16, generator=torch.Generator().manual_seed(1))  # GQA: 4 q / 2 kv
    layer = cache.layers[0]
    got = decode_attention(query, own_k, own_v, layer.prefix_keys, layer.prefix_values, cache, 0.25, backend,
                           layer.tail_keys, layer.tail_values)
    ref = _dense_shared(query, pk, pv, [queries[q] for q in row_query], own_k, own_v, 0.25)
    assert float((got.double() - ref).abs().max()) < 1e-5
    keep = torch.tensor([1, 2, 5])  # rows of queries 0, 1, 2 only: share 1 and share 2 leave, query 0 keeps one row
    full = cache.kv_bytes()
    cache.reorder_cache(keep)
    assert layer.prefix_keys.shape[0] == 1 and layer.tail_keys.shape[0] == 3 and cache.kv_bytes() < full
    got = decode_attention(query[keep], layer.own_keys[:, :, :3], layer.own_values[:, :, :3], layer.prefix_keys,
                           layer.prefix_values, cache, 0.25, backend, layer.tail_keys, layer.tail_values)
    assert float((got.double() - ref[keep]).abs().max()) < 1e-5


# ---- CUDA (skipped without a GPU; UNTESTED on a GPU so far) ----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["math", "sdpa"])  # math: what "auto" picks on CUDA
@pytest.mark.parametrize("family", VL)
def test_cuda_shared_equals_copy_fp32(family, backend, load_tiny):
    """The shared path on CUDA in float32 (the packed prefill under the grouped attention's CUDA path, the three levels
    through the cascade kernel `backend`): token-identical to the copy path, logprobs within 1e-4 of the recompute."""
    model, processor = load_tiny(family)
    model = model.to("cuda")
    inputs = {k: (v.to("cuda") if torch.is_tensor(v) else v) for k, v in shared_batch(processor, PROMPTS).items()}
    greedy = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=())
    copy = HFEngine(model, processor, decode="copy").generate_groups(inputs, GROUPS, greedy)
    engine = HFEngine(model, processor, decode="cascade", cascade_backend=backend)
    shared = engine.generate_groups(inputs, GROUPS, greedy)
    assert engine.last_stats["shared_prompts"] == 4
    assert torch.equal(copy.completion_ids, shared.completion_ids)
    assert_recompute_matches(model, inputs, shared, 1.0, LOGP_ATOL)
