"""The log-sum-exp merge: attentions of the same queries over disjoint key sets, combined into the attention over
their union, exactly (the identity the grouped forward rests on, `mmpg.grouping`).

For parts x with o_x = softmax(s_x) V_x and lse_x = log Σ_{keys of x} e^s (s the scaled scores):

    lse = log Σ_x e^lse_x,    o = Σ_x e^(lse_x - lse) · o_x

One function serves every caller: the `flash` and `lse_reference` backends (`backends.varlen`, two parts), the
`sdpa` backend's CPU path (`backends.sdpa`, two parts) and cascade decoding and chunked prefill
(`mmpg.rollout.cascade_attention`, two or three parts).
"""

from __future__ import annotations

import torch


def merge_attention(parts, dtype: torch.dtype | None = None):
    """[(o_x [..., E], lse_x [...])] -> (o [..., E] in `dtype`, lse [...]); `dtype` defaults to the first o's.

    lse_x has o_x's leading shape (a caller whose LSE is laid out otherwise passes a transposed view; the merged LSE
    keeps that memory layout). The weighted sum runs in float32, or float64 where `dtype` or an LSE is float64; the
    merged lse keeps the LSEs' promoted dtype. Parts are added left to right.

    Empty parts: a part with lse_x = -inf (none of its keys seen, e.g. a row whose past is all padding) gets weight
    exactly 0, provided its o_x is finite (0 · NaN is NaN: compute such a part on any keys, then set its lse to
    -inf). Every query needs one part with a finite lse, or its output is NaN.
    """
    out_dtype = parts[0][0].dtype if dtype is None else dtype
    lse = parts[0][1]
    for _, lse_x in parts[1:]:
        lse = torch.logaddexp(lse, lse_x)
    acc = torch.promote_types(lse.dtype, torch.promote_types(out_dtype, torch.float32))
    out = parts[0][0].to(acc) * torch.exp(parts[0][1] - lse)[..., None]
    for o_x, lse_x in parts[1:]:
        out = out + o_x.to(acc) * torch.exp(lse_x - lse)[..., None]
    return out.to(out_dtype), lse
