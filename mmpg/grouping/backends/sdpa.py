"""`sdpa` backend: exact grouped attention with torch's scaled_dot_product_attention (default on CPU).

Per group b (prefix P_b tokens, responses R_b = sum_g S_bg tokens, contiguous in the row):
    prefix queries   -> prefix keys, causal                          one SDPA call, no mask
    response queries -> keys [prefix_b | responses_b] (a view)       one SDPA call, bool mask [R_b, P_b + R_b]
The keys of the second call are a slice of the row, so the prefix K/V is never copied, let alone once per response.
The cost above the ideal is the masked-out response x other-response blocks, R_b^2 - sum_g S_bg^2 score entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpg.grouping.layout import GroupLayout


def response_mask(layout: GroupLayout, b: int) -> torch.Tensor:
    """[R_b, P_b + R_b] bool: a response token sees the whole prefix and the earlier tokens of its own response."""
    cache = layout.__dict__.setdefault("_sdpa_masks", {})
    if b not in cache:
        P = layout.prefix_lens[b]
        seg = layout.response_segment_ids[b]  # [R_b]
        R = seg.numel()
        pos = torch.arange(R, device=seg.device)
        own = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])  # [R_b, R_b]
        prefix = torch.ones(R, P, dtype=torch.bool, device=seg.device)
        cache[b] = torch.cat([prefix, own], dim=1)
    return cache[b]


def sdpa_grouped_attention(query, key, value, layout: GroupLayout, scaling: float) -> torch.Tensor:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D] (the layout transformers expects back)."""
    gqa = query.shape[1] != key.shape[1]
    pieces = []
    for b in range(layout.num_groups):
        a, e = layout.prefix_span(b)
        r0, r1 = layout.responses_span(b)
        pieces.append(F.scaled_dot_product_attention(
            query[:, :, a:e], key[:, :, a:e], value[:, :, a:e], is_causal=True, scale=scaling, enable_gqa=gqa))
        pieces.append(F.scaled_dot_product_attention(
            query[:, :, r0:r1], key[:, :, a:r1], value[:, :, a:r1], attn_mask=response_mask(layout, b),
            scale=scaling, enable_gqa=gqa))
    return torch.cat(pieces, dim=2).transpose(1, 2)
