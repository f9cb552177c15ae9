"""`flex` backend: FlexAttention over the packed row with a block mask (compiled with dynamic shapes).

mask_mod(q, kv) = same group  and  kv <= q  and  (kv is a prefix token  or  kv is in q's own response).
Blocks that are fully masked (other groups, other responses) are skipped by the kernel, so the cost tracks the ideal
attention FLOPs up to block granularity. On CPU only the forward runs (FlexAttention has no CPU backward).
"""

from __future__ import annotations

import functools

import torch

from mmpg.grouping.layout import GroupLayout


def block_mask(layout: GroupLayout):
    cached = layout.__dict__.get("_flex_block_mask")
    if cached is not None:
        return cached
    group, resp = layout.token_labels()

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (resp[kv_idx] == -1) | (resp[kv_idx] == resp[q_idx])
        return (group[q_idx] == group[kv_idx]) & (kv_idx <= q_idx) & visible

    mask = _compiled_create_block_mask()(mask_mod, B=None, H=None, Q_LEN=layout.total, KV_LEN=layout.total,
                                         device=str(layout.device))
    layout.__dict__["_flex_block_mask"] = mask
    return mask


@functools.cache
def _compiled_create_block_mask():
    """create_block_mask compiled the way torch 2.14 documents (`torch.compile(create_block_mask)`; its `_compile=True`
    flag is deprecated and warns on every call). Compiled, it builds the block mask blockwise; uncompiled it would
    materialise a dense [T, T] mask first. One compiled function for the process, so layouts reuse its graphs."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def flex_grouped_attention(query, key, value, layout: GroupLayout, scaling: float) -> torch.Tensor:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D]."""
    out = _compiled_flex()(query, key, value, block_mask=block_mask(layout), scale=scaling,
                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)
