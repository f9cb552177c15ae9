"""The decode attention of cascade decoding, registered through transformers' `AttentionInterface`.

`register_cascade_attention(base)` registers `mmpg_cascade_<base>` (see `cascade_name`), and `base`'s mask function
under that name. It behaves exactly like `base` — the implementation the text model uses now, possibly mmpg's grouped
one — unless the layer call carries `mmpg_cascade=<CascadeCall>` in its kwargs, which only `HFEngine`'s cascade decode
step passes; then `key`/`value` are the row's own K/V that `SharedPrefixCache` returned and the prefix comes from the
cache:

    query [n, Hq, 1, D] --view--> [n, Hkv, rep, D]                     (rep = Hq / Hkv: GQA heads folded into Lq)
      prefix part: rows of prompt b stacked  [B', Hkv, G_max·rep, D] x prefix K/V [B', Hkv, L, D]   one call
      own part:                              [n, Hkv, rep, D]        x own K/V   [n, Hkv, t + 1, D]  one call
      merged by log-sum-exp -> [n, 1, Hq, D]  (what transformers expects back)

Under a tree (`mmpg.rollout.shares`) a third part joins: the tails level, rows of query q stacked
[Q', Hkv, G_max·rep, D] x tail K/V [Q', Hkv, L_t, D] with the tails' key mask; the three are merged the same way.
The tree's prefill is one packed forward whose layer calls carry `mmpg_layout` too: they run mmpg's grouped attention
(`mmpg.grouping.attention`, registered for the same base) under that layout.

`cascade_attention_enabled(model)` selects the registered name for the text model for the duration of a `with` block
and restores the previous one after (the vision tower keeps its own attention). No modeling code is copied and no
module's `forward` is replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mmpg.grouping.attention import LAYOUT_KWARG, base_attention, check_tripwire, register_grouped_attention
from mmpg.rollout.cascade import SharedPrefixCache
from mmpg.rollout.cascade_kernels import attend

PREFIX = "mmpg_cascade_"
CASCADE_KWARG = "mmpg_cascade"


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


def _make_attention(base: str):
    def cascade_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        call = kwargs.pop(CASCADE_KWARG, None)
        if call is None:
            return base_attention(base, module)(module, query, key, value, attention_mask, scaling=scaling,
                                                dropout=dropout, **kwargs)
        check_tripwire(call.model_inputs, kwargs, module, "cascade decoding")
        if call.prefill:
            # a packed tree prefill carries a layout: the grouped attention for this base runs it (and its tripwire)
            fn = ALL_ATTENTION_FUNCTIONS[register_grouped_attention(base)] if LAYOUT_KWARG in kwargs else \
                base_attention(base, module)
            return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if kwargs.get("sliding_window") is not None:
            raise ValueError("cascade decoding does not support sliding-window layers (use_sliding_window=False)")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        layer = call.cache.layers[module.layer_idx]
        return decode_attention(query, key, value, layer.prefix_keys, layer.prefix_values, call.cache, scale,
                                call.backend, layer.tail_keys, layer.tail_values), None

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
    name = cascade_name(base)
    if name not in ALL_ATTENTION_FUNCTIONS:
        if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"attention implementation {base!r} is not registered in transformers")
        AttentionInterface.register(name, _make_attention(base))
        mask = ALL_MASK_ATTENTION_FUNCTIONS.get(base, eager_mask if base == "eager" else sdpa_mask)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
    return name


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
                     backend: str, tail_k=None, tail_v=None) -> torch.Tensor:
    """query [n, Hq, 1, D]; own K/V [n, Hkv, t + 1, D]; prefix K/V [B', Hkv, L, D] (a tree's shared parts);
    tail K/V [Q', Hkv, L_t, D] or None (no tree) -> out [n, 1, Hq, D]."""
    n, hq, q_len, d = query.shape
    hkv = own_k.shape[1]
    if q_len != 1:
        raise ValueError(f"cascade decode attention takes one query per row, got {q_len}")
    rep = hq // hkv
    q = query.reshape(n, hkv, rep, d)  # query head h uses kv head h // rep (transformers' repeat_kv)
    levels = [(prefix_k, prefix_v, cache.levels[0])]
    if tail_k is not None:
        levels.append((tail_k, tail_v, cache.levels[1]))
    parts = []  # (o [n, Hkv, rep, D], lse [n, Hkv, rep]) per part: the shared levels, then the own tokens
    for k, v, level in levels:
        o, lse = attend(_stack(q, level.rows), k, v, level.mask, scale, backend)
        parts.append((_unstack(o, level.rows, rep), _unstack(lse[..., None], level.rows, rep)[..., 0]))
    parts.append(attend(q, own_k, own_v, None, scale, backend))
    lse = parts[0][1]
    for _, lse_x in parts[1:]:
        lse = torch.logaddexp(lse, lse_x)
    acc = lse.dtype if query.dtype != torch.float64 else torch.float64
    out = parts[0][0].to(acc) * torch.exp(parts[0][1] - lse)[..., None]
    for o_x, lse_x in parts[1:]:
        out = out + o_x.to(acc) * torch.exp(lse_x - lse)[..., None]
    return out.to(query.dtype).reshape(n, 1, hq, d)


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
