"""Ulysses attention for a packed row spread over the sp ranks of a sequence-parallel group.

Each rank holds one contiguous shard of the packed row (`mmpg.grouping.sequence`): T_pad = sp * T_loc tokens, the
real row T <= T_pad followed by padding. Everything in a decoder layer but attention runs on the shard; around
attention

    q/k/v [1, H, T_loc, D] (my tokens, all heads) --all-to-all--> [1, H/sp, T, D] (every token, my heads)
    the unchanged grouped backend on the whole row and the layout       -> [1, T, Hq/sp, D]
    --all-to-all back--> [1, T_loc, Hq, D] (my tokens, all heads)

Attention is independent per head, so this is the grouped attention itself, exactly, for every backend and layout.
GQA: rank r takes query heads [r Hq/sp, (r+1) Hq/sp) and their key/value heads when sp divides Hkv; otherwise each
kv head is first repeated c = lcm(Hkv, sp) / Hkv times (lcm(Hkv, sp) divides Hq), the repeat's backward summing the
copies' gradients. Not DeepSpeed's Ulysses: mmpg.grouping imports no trainer framework, and DeepSpeed's HF wrapper
drops 4-D masks and rebuilds a flex mask as causal (no grouped layout), and assumes the row divides by sp. The
collectives are `all_to_all_single` in a small autograd function whose backward is the same exchange in reverse.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def kv_repeats(q_heads: int, kv_heads: int, sp: int) -> int:
    """How many times each kv head is repeated before the split (1 when sp divides the kv heads)."""
    return math.lcm(kv_heads, sp) // kv_heads


def check_heads(q_heads: int, kv_heads: int, sp: int) -> str | None:
    """None when the attention heads can be split over sp ranks, else one line saying why not."""
    if sp <= 1:
        return None
    if q_heads % sp:
        return (f"the model's {q_heads} attention heads cannot be split over sequence_parallel_size={sp} ranks "
                f"(Ulysses gives each rank heads/sp of them); use a size that divides {q_heads}")
    if q_heads % kv_heads:
        return f"the model's {q_heads} attention heads are not a multiple of its {kv_heads} key/value heads"
    return None  # kv heads split (sp | Hkv) or repeated lcm(Hkv, sp) / Hkv times, which divides Hq


class _AllToAll(torch.autograd.Function):
    """x [sp, ...] on every rank: chunk j goes to rank j, which stores it at index (my rank). Its own transpose, so
    the backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, shard) -> torch.Tensor:
    """[1, H, T_loc, D] (this rank's tokens) -> [1, H/sp, T, D] (the whole real row, this rank's heads)."""
    sp = shard.size
    _, heads, t_loc, d = x.shape
    chunks = x[0].reshape(sp, heads // sp, t_loc, d)  # chunk j: the heads rank j takes
    got = _AllToAll.apply(chunks, shard.group)  # [sp, H/sp, T_loc, D]: index i = rank i's tokens
    row = got.permute(1, 0, 2, 3).reshape(heads // sp, sp * t_loc, d)
    return row[:, :shard.total][None]


def heads_to_seq(out: torch.Tensor, shard) -> torch.Tensor:
    """[1, T, Hq/sp, D] (the whole real row, this rank's heads) -> [1, T_loc, Hq, D] (this rank's tokens)."""
    sp = shard.size
    _, total, heads, d = out.shape
    out = F.pad(out[0], (0, 0, 0, 0, 0, shard.padded - total))  # [T_pad, Hq/sp, D]; padding attends to nothing
    got = _AllToAll.apply(out.reshape(sp, shard.local, heads, d), shard.group)  # index i = rank i's heads
    return got.permute(1, 0, 2, 3).reshape(shard.local, sp * heads, d)[None]


def ulysses_attention(backend, query, key, value, layout, scale):
    """The grouped backend on the whole row for this rank's heads. query [1, Hq, T_loc, D], key/value
    [1, Hkv, T_loc, D] -> [1, T_loc, Hq, D]."""
    shard = layout.sequence
    rep = kv_repeats(query.shape[1], key.shape[1], shard.size)
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = (seq_to_heads(x, shard) for x in (query, key, value))
    return heads_to_seq(backend(q, k, v, layout, scale), shard)
