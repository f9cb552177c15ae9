"""The decode attention of cascade decoding, registered through transformers' `AttentionInterface`.

`register_cascade_attention(base)` registers `mmpg_cascade_<base>` (`cascade_name`) with the mask function of the
implementation its ordinary calls run (`mmpg.grouping.attention._ordinary`: sdpa for a flash-loaded model, whose
ordinary and prefill calls need sdpa's 4-D mask). It behaves exactly like `base` (the text model's implementation,
possibly mmpg's grouped one) unless the layer call carries one of mmpg's kwargs:

    mmpg_cascade=CascadeCall (HFEngine's decode step): `key`/`value` are the row's own K/V from `SharedPrefixCache`
      query [n, Hq, 1, D] --view--> [n, Hkv, rep, D]                     (rep = Hq / Hkv: GQA heads folded into Lq)
      prefix part: rows of prompt b stacked  [B', Hkv, G_max·rep, D] x prefix K/V [B', Hkv, L, D]   one call
      tails part (video sharing):            [Q', Hkv, G_max·rep, D] x tail K/V   [Q', Hkv, L_t, D] with its key mask
      own part:                              [n, Hkv, rep, D]        x own K/V   [n, Hkv, t + 1, D]  one call
      history part (a later turn):           [n, Hkv, rep, D]        x history   [n, Hkv, H, D]      its key mask
      merged by log-sum-exp -> [n, 1, Hq, D]  (what transformers expects back); a later turn's chunk of C tokens
      folds C into the query length the same way ([n, Hkv, rep·C, D]), its own part causal
    CascadeCall(prefill=True): the prefill; a packed shared prefill (with `mmpg_layout`) runs the grouped attention
    CascadeCall(tails=True): a chunked shared prefill's tails forward (`tails_attention`)
    mmpg_prefill_chunk=ChunkCall: a chunk of a chunked prefill (`chunk_attention`: no [chunk × prompt] mask)

`cascade_attention_enabled(model)` selects the registered name for the text model inside a `with` block and
restores the previous one after (the vision tower keeps its own attention). No modeling code is copied and no
module's `forward` is replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mmpg.grouping.attention import (
    LAYOUT_KWARG, base_attention, check_tripwire, register_grouped_attention, register_wrapping,
)
from mmpg.grouping.merge import merge_attention
from mmpg.rollout.cascade import SharedPrefixCache, _Rows
from mmpg.rollout.cascade_kernels import _flash_cpu, attend

PREFIX = "mmpg_cascade_"
CASCADE_KWARG = "mmpg_cascade"
CHUNK_KWARG = "mmpg_prefill_chunk"


@dataclasses.dataclass
class CascadeCall:
    """What one decode forward hands every layer: the cache and the resolved kernel backend."""

    cache: SharedPrefixCache
    backend: str  # a resolved name of `mmpg.rollout.cascade_kernels` (sdpa, flash, math)
    # keys the engine hands to the decode forward for the model to consume (the cache, logits_to_keep; not use_cache,
    # which some releases hand every attention call on purpose):
    # one arriving in the attention kwargs was ignored by the model, and the call raises (`check_tripwire`)
    model_inputs: tuple[str, ...] = ()
    prefill: bool = False  # the prefill forward: the model's own attention fills the cache, after the tripwire
    tails: bool = False  # a chunked shared prefill's tails forward, behind its shared parts (`tails_attention`)


@dataclasses.dataclass
class ChunkCall:
    """What one chunk of a chunked prefill hands every layer (`HFEngine._prefill_chunks`, `chunk_attention`)."""

    key_mask: torch.Tensor | None  # [B, K] bool over the cache's keys so far and the chunk's (False: left padding)
    backend: str  # a resolved name of `mmpg.rollout.cascade_kernels`
    model_inputs: tuple[str, ...] = ()  # the tripwire's keys, as `CascadeCall.model_inputs`


def _make_attention(base: str):
    def cascade_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        call = kwargs.pop(CASCADE_KWARG, None)
        chunk = kwargs.pop(CHUNK_KWARG, None)
        if call is None and chunk is None:
            return base_attention(base, module)(module, query, key, value, attention_mask, scaling=scaling,
                                                dropout=dropout, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if chunk is not None:
            check_tripwire(chunk.model_inputs, kwargs, module, "chunked prefill")
            if kwargs.get("sliding_window") is not None:
                raise ValueError("a chunked prefill does not support sliding-window layers; set prefill_chunk=0")
            return chunk_attention(query, key, value, chunk.key_mask, scale, chunk.backend), None
        check_tripwire(call.model_inputs, kwargs, module, "cascade decoding")
        if call.tails:
            layer = call.cache.layers[module.layer_idx]
            return tails_attention(query, layer.tail_keys, layer.tail_values, layer.prefix_keys, layer.prefix_values,
                                   call.cache.split, scale, call.backend), None
        if call.prefill:
            # a packed shared prefill carries a layout: the grouped attention for this base runs it (and its tripwire)
            fn = ALL_ATTENTION_FUNCTIONS[register_grouped_attention(base)] if LAYOUT_KWARG in kwargs else \
                base_attention(base, module)
            return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if kwargs.get("sliding_window") is not None:
            raise ValueError("cascade decoding does not support sliding-window layers (use_sliding_window=False)")
        layer = call.cache.layers[module.layer_idx]
        return decode_attention(query, key, value, layer.prefix_keys, layer.prefix_values, call.cache, scale,
                                call.backend, layer.tail_keys, layer.tail_values, layer.history_keys,
                                layer.history_values), None

    cascade_attention.__name__ = cascade_name(base).replace("-", "_")
    return cascade_attention


def cascade_name(base: str) -> str:
    """Registry name of the cascade function wrapping `base`. It never contains "flash": transformers 5.24 takes such
    a name for a flash kernel to load when it is set (flash_attention_2 -> mmpg_cascade_fa2)."""
    if base.startswith(PREFIX):
        return base
    return PREFIX + re.sub(r"flash[_-]?(attention|attn)?[_-]?", "fa", base).replace("/", "_").replace(":", "_")


def register_cascade_attention(base: str) -> str:
    """Register (once) the cascade function wrapping `base`; returns its registry name."""
    if base.startswith(PREFIX):
        return base
    return register_wrapping(cascade_name(base), base, _make_attention)


@contextlib.contextmanager
def cascade_attention_enabled(model):
    """Select `mmpg_cascade_<current>` for the text model inside the block; the previous implementation after."""
    text_config = model.config.get_text_config()
    current = text_config._attn_implementation or "eager"
    name = register_cascade_attention(current)
    _set_text_attention(model, name)
    try:
        yield
    finally:
        _set_text_attention(model, current)


def _set_text_attention(model, name: str) -> None:
    if model.config.get_text_config() is model.config:
        model.set_attn_implementation(name)
    else:
        model.set_attn_implementation({"text_config": name})


def decode_attention(query, own_k, own_v, prefix_k, prefix_v, cache: SharedPrefixCache, scale: float,
                     backend: str, tail_k=None, tail_v=None, history_k=None, history_v=None) -> torch.Tensor:
    """query [n, Hq, C, D]; own K/V [n, Hkv, t + C, D]; prefix K/V [B', Hkv, L, D] (the shared videos' parts);
    tail K/V [Q', Hkv, L_t, D] or None (no sharing); history K/V [n, Hkv, H, D] or None (a first turn) -> out
    [n, C, Hq, D]. C = 1 (a decode step) or, in a later turn of a multi-turn rollout, the turn's chunk (its own part
    causal, its left padding masked by `cache.own_mask`; the module docstring of `mmpg.rollout.cascade`)."""
    n, hq, q_len, d = query.shape
    hkv = own_k.shape[1]
    if q_len != 1 and cache.own_mask is None:
        raise ValueError(f"cascade decode attention takes one query per row, got {q_len}")
    rep = hq // hkv
    q = query.reshape(n, hkv, rep * q_len, d)  # query head h uses kv head h // rep (transformers' repeat_kv)
    levels = [(prefix_k, prefix_v, cache.levels[0])]
    if tail_k is not None:
        levels.append((tail_k, tail_v, cache.levels[1]))
    parts = []  # (o [n, Hkv, rep·C, D], lse [n, Hkv, rep·C]) per part: the shared levels, history, the own tokens
    for k, v, level in levels:
        o, lse = attend(_stack(q, level.rows), k, v, level.mask, scale, backend)
        parts.append((_unstack(o, level.rows, rep * q_len), _unstack(lse[..., None], level.rows, rep * q_len)[..., 0]))
    if history_k is not None:
        mask = cache.history_mask
        empty = None if mask is None else ~mask.any(dim=1)  # [n] branches with no earlier key
        if empty is not None and bool(empty.any()):
            mask = mask | empty[:, None]  # computed on the padding, then weighted 0
        else:
            empty = None
        o, lse = attend(q, history_k, history_v, mask, scale, backend)
        parts.append((o, lse if empty is None else lse.masked_fill(empty[:, None, None], float("-inf"))))
    own = None if cache.own_mask is None else cache.own_mask[:, : own_k.shape[2]]
    if q_len == 1:
        parts.append(attend(q, own_k, own_v, None if own is None or bool(own.all()) else own, scale, backend))
    else:  # a turn's chunk: causal, real keys only, each query sees itself
        at = torch.arange(q_len, device=query.device)
        mask = (own[:, None, :] & (at[:, None] >= at[None, :])) | (at[:, None] == at[None, :])  # [n, C, C]
        parts.append(_masked_attention(q, own_k, own_v, mask.repeat(1, rep, 1), scale))
    out = merge_attention(parts, query.dtype)[0]  # [n, Hkv, rep·C, D]
    return out.reshape(n, hkv, rep, q_len, d).permute(0, 3, 1, 2, 4).reshape(n, q_len, hq, d)


def tails_attention(query, tail_k, tail_v, shared_k, shared_v, split, scale: float, backend: str) -> torch.Tensor:
    """The tails forward of a chunked shared prefill: query [Q, Hq, L_t, D] of every query's tail (left-padded as
    split.tail_mask), tail K/V [Q, Hkv, L_t, D], shared K/V [S, Hkv, L_s, D] (padded as split.shared_mask) -> out
    [Q, L_t, Hq, D]. Tail token l of query q attends to its share's whole shared part (one query block per share,
    the Lt·rep queries of its tails folded into the query length, as decoding folds rows) and to tail tokens j <= l
    of its own tail; the two parts merged by log-sum-exp. A padding query also sees itself (never read: no real
    query attends to a padding key), so no row is empty."""
    nq, hq, lt, d = query.shape
    hkv = tail_k.shape[1]
    rep = hq // hkv
    q = query.reshape(nq, hkv, rep * lt, d)  # query head h = kv·rep + r, tail token l -> row r·L_t + l
    rows = _Rows(split.query_share)
    shared_mask = None if bool(split.shared_mask.all()) else split.shared_mask
    o, lse = attend(_stack(q, rows), shared_k, shared_v, shared_mask, scale, backend)
    parts = [(_unstack(o, rows, rep * lt), _unstack(lse[..., None], rows, rep * lt)[..., 0])]
    at = torch.arange(lt, device=query.device)
    own = (split.tail_mask[:, None, :] & (at[:, None] >= at[None, :])) | (at[:, None] == at[None, :])  # [Q, Lt, Lt]
    parts.append(_masked_attention(q, tail_k, tail_v, own.repeat(1, rep, 1), scale))
    out = merge_attention(parts, query.dtype)[0]  # [Q, Hkv, rep·L_t, D]
    return out.reshape(nq, hkv, rep, lt, d).permute(0, 3, 1, 2, 4).reshape(nq, lt, hq, d)


def _masked_attention(q, k, v, mask, scale: float):
    """q [B, H, Lq, D], k/v [B, H, Lk, D], mask [B, Lq, Lk] bool (every row has a True) -> (out [B, H, Lq, D] in q's
    dtype, lse [B, H, Lq] float32 or float64), in float32 (float64 for float64 inputs): short tails only."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.to(acc)).to(q.dtype), lse


def _stack(q, rows) -> torch.Tensor:
    """[n, Hkv, rep, D] -> [B', Hkv, G_max·rep, D]: each prompt's live rows as one query block (zeros pad it)."""
    _, hkv, rep, d = q.shape
    if rows.equal:
        block = q.view(rows.num_prompts, rows.g_max, hkv, rep, d)
    else:
        block = q.new_zeros(rows.num_prompts, rows.g_max, hkv, rep, d)
        block[rows.group, rows.slot] = q
    return block.permute(0, 2, 1, 3, 4).reshape(rows.num_prompts, hkv, rows.g_max * rep, d)


def _unstack(x, rows, rep) -> torch.Tensor:
    """[B', Hkv, G_max·rep, E] -> [n, Hkv, rep, E] (the inverse of `_stack`)."""
    b, hkv, _, e = x.shape
    x = x.view(b, hkv, rows.g_max, rep, e).permute(0, 2, 1, 3, 4)  # [B', G_max, Hkv, rep, E]
    if rows.equal:
        return x.reshape(-1, hkv, rep, e)
    return x[rows.group, rows.slot]


def chunk_attention(query, key, value, key_mask, scale: float, backend: str) -> torch.Tensor:
    """One chunk of a chunked prefill: query [B, Hq, C, D]; key/value [B, Hkv, K, D], the cache's keys so far with
    the chunk's own last (K = past + C); key_mask [B, K] bool (False: left padding) or None -> out [B, C, Hq, D].

        past part   every real past key:  [B, Hkv, rep·C, D] (GQA heads folded into Lq) x [B, Hkv, past, D]
        own part    causal in the chunk:  key j <= query i, real keys only, and each query sees itself
        merged by log-sum-exp

    The same softmax as one causal forward over the whole prompt, without its [C, K] mask: memory follows the chunk.
    A padding query's output is never read (no real query attends to a padding key); a row whose past is all padding
    contributes no past part."""
    b, hq, c, d = query.shape
    hkv = key.shape[1]
    rep, past = hq // hkv, key.shape[2] - c
    parts = []
    if past > 0:
        mask = None if key_mask is None or bool(key_mask[:, :past].all()) else key_mask[:, :past]
        empty = None if mask is None else ~mask.any(dim=1)  # [B] rows with no real past key yet
        if empty is not None:
            mask = mask | empty[:, None]  # their past part is computed on every key, then weighted 0
        o, lse = attend(query.reshape(b, hkv, rep * c, d), key[:, :, :past], value[:, :, :past], mask, scale, backend)
        lse = lse.reshape(b, hq, c)
        if empty is not None and bool(empty.any()):
            lse = lse.masked_fill(empty[:, None, None], float("-inf"))
        parts.append((o.reshape(b, hq, c, d), lse))
    own = None if key_mask is None else key_mask[:, past:]
    at = torch.arange(c, device=query.device)
    causal = at[:, None] >= at[None, :]  # [C, C]
    mask = None if own is None or bool(own.all()) else (own[:, None, :] & causal) | (at[:, None] == at[None, :])
    k, v = key[:, :, past:].repeat_interleave(rep, dim=1), value[:, :, past:].repeat_interleave(rep, dim=1)
    if backend == "sdpa" and query.device.type == "cpu":  # torch's CPU flash kernel, with its LSE
        additive = None if mask is None else \
            query.new_zeros(mask.shape).masked_fill_(~mask, float("-inf"))[:, None]  # [B, 1, C, C]
        o, lse = _flash_cpu(query, k, v, 0.0, additive is None, attn_mask=additive, scale=scale)
        parts.append((o, lse.float()))
    else:
        full = causal.expand(b, c, c) if mask is None else mask
        parts.append(_masked_attention(query, k, v, full, scale))
    return merge_attention(parts, query.dtype)[0].transpose(1, 2).contiguous()
