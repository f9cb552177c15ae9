"""`sdpa` backend: exact grouped attention with torch's own attention kernels (default on CPU).

Per group b (prefix P_b tokens, then its responses, R_b = sum_g S_bg tokens, contiguous in the row):

    prefix queries   -> prefix keys, causal                 F.scaled_dot_product_attention, is_causal, no mask
    response queries -> prefix keys + own earlier tokens    one of two exact paths:

  CPU (`_CpuResponses`): two calls of torch's CPU flash kernel, which returns the log-sum-exp —
        (a) all R_b response queries against the P_b prefix keys, no mask;
        (b) the G_b responses as a batch [G_b, H, S_max, D], causal (padding at the end of a row is never seen);
      merged by their log-sum-exp, with a custom backward that runs the kernel's backward on both parts with the
      merged output and LSE (the ring-attention identity, as in the `flash` backend). No mask is built, the prefix
      K/V is read in place (copied once per group only to expand GQA heads), and no score is computed that the
      rule masks out, except in the short padding of (b).
  Other devices (`_masked_responses`): one SDPA call of the R_b queries against the keys [prefix_b | responses_b] (a
      slice of the row; GQA heads expanded once per group, see MASKED_EXPAND_KV_HEADS) with a bool mask
      [R_b, P_b + R_b]; exact, but computes the R_b^2 - sum S_bg^2 masked scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpg.grouping.layout import GroupLayout
from mmpg.grouping.merge import merge_attention

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


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


# Masked path on CUDA: expand GQA K/V heads (one copy of the group's K/V per query head) or pass `enable_gqa=True`.
# The copy guards against SDPA's memory-efficient kernel (the only fused CUDA kernel that takes an arbitrary mask)
# refusing `enable_gqa` and falling back to the math kernel and its full [R_b, P_b + R_b] score matrix per head.
# torch 2.14's documentation lists GQA support for the memory-efficient kernel too; if that holds,
# the copy only costs memory (Hq/Hkv times the group's K/V). Unmeasured: `python -m mmpg.bench.sdpa_kernels` prints
# which kernel runs each way (profiler kernel names); flip this flag when a GPU run shows the memory-efficient kernel
# with enable_gqa. Both settings are exact (tested on CPU; on CUDA in tests/test_grouping_gpu.py).
MASKED_EXPAND_KV_HEADS = True


def _masked_responses(q, k, v, layout, b, scale):
    a, _ = layout.prefix_span(b)
    r0, r1 = layout.responses_span(b)
    rep = q.shape[1] // k.shape[1]
    keys, values = k[:, :, a:r1], v[:, :, a:r1]
    if MASKED_EXPAND_KV_HEADS:
        keys, values = _expand_heads(keys, rep), _expand_heads(values, rep)
    return F.scaled_dot_product_attention(q[:, :, r0:r1], keys, values, attn_mask=response_mask(layout, b),
                                          scale=scale, enable_gqa=not MASKED_EXPAND_KV_HEADS and rep > 1)


class _Batched:
    """Moves the R_b response tokens of a group between the row layout [1, H, R_b, ...] and a padded batch
    [G_b, H, S_max, ...] (responses right-padded with copies of an existing token)."""

    def __init__(self, lens: list[int], device):
        self.lens, self.smax = lens, max(lens)
        self.equal = all(s == self.smax for s in lens)
        starts = torch.tensor([0] + lens[:-1], device=device).cumsum(0)  # [G]
        offs = torch.arange(self.smax, device=device)
        self.valid = offs[None, :] < torch.tensor(lens, device=device)[:, None]  # [G, S_max]
        self.index = starts[:, None] + torch.minimum(offs[None, :], torch.tensor(lens, device=device)[:, None] - 1)

    def gather(self, x):
        """[1, H, R, *rest] -> [G, H, S_max, *rest]."""
        if self.equal:
            return x[0].unflatten(1, (len(self.lens), self.smax)).transpose(0, 1)
        return x[0][:, self.index].transpose(0, 1)

    def scatter(self, y):
        """[G, H, S_max, *rest] -> [1, H, R, *rest] (padding dropped)."""
        if self.equal:
            return y.transpose(0, 1).flatten(1, 2)[None]
        return y.transpose(0, 1)[:, self.valid][None]


def _expand_heads(x, rep):
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _reduce_heads(dx, rep):
    return dx.unflatten(1, (dx.shape[1] // rep, rep)).sum(2) if rep > 1 else dx


class _CpuResponses(torch.autograd.Function):
    """Response attention of one group on CPU: prefix part and own part merged by log-sum-exp (module docstring)."""

    @staticmethod
    def forward(ctx, q, kp, vp, kr, vr, batched: _Batched, scale: float):
        # q [1, Hq, R, D]; kp/vp [1, Hkv, P, D]; kr/vr [1, Hkv, R, D]
        rep = q.shape[1] // kp.shape[1]
        o_a, lse_a = _flash_cpu(q, _expand_heads(kp, rep), _expand_heads(vp, rep), 0.0, False, scale=scale)
        o_b, lse_b = _flash_cpu(batched.gather(q), batched.gather(_expand_heads(kr, rep)),
                                batched.gather(_expand_heads(vr, rep)), 0.0, True, scale=scale)
        o_b, lse_b = batched.scatter(o_b), batched.scatter(lse_b)  # [1, Hq, R, D], [1, Hq, R]
        out, lse = merge_attention([(o_a, lse_a), (o_b, lse_b)], q.dtype)  # lse float32 (float64 for float64)
        ctx.save_for_backward(q, kp, vp, kr, vr, out, lse)
        ctx.batched, ctx.scale = batched, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kp, vp, kr, vr, out, lse = ctx.saved_tensors
        batched, scale = ctx.batched, ctx.scale
        rep = q.shape[1] // kp.shape[1]
        dout = dout.contiguous()
        dq, dkp, dvp = _flash_cpu_backward(dout, q, _expand_heads(kp, rep).contiguous(),
                                           _expand_heads(vp, rep).contiguous(), out, lse, 0.0, False, scale=scale)
        # padded queries: zero gradient in, and an infinite LSE so their probabilities are exactly 0
        pad = ~batched.valid[:, None, :]  # [G, 1, S_max]
        dq_b, dkr, dvr = _flash_cpu_backward(
            batched.gather(dout).masked_fill(pad[..., None], 0.0).contiguous(),
            batched.gather(q).contiguous(),
            batched.gather(_expand_heads(kr, rep)).contiguous(),
            batched.gather(_expand_heads(vr, rep)).contiguous(),
            batched.gather(out).contiguous(),
            batched.gather(lse).masked_fill(pad, float("inf")).contiguous(),
            0.0, True, scale=scale)
        dq = dq + batched.scatter(dq_b)
        dkr, dvr = batched.scatter(dkr), batched.scatter(dvr)  # padded keys come after every real query: grad 0
        return (dq, _reduce_heads(dkp, rep), _reduce_heads(dvp, rep), _reduce_heads(dkr, rep),
                _reduce_heads(dvr, rep), None, None)


def _cpu_responses(q, k, v, layout, b, scale):
    a, e = layout.prefix_span(b)
    r0, r1 = layout.responses_span(b)
    cache = layout.__dict__.setdefault("_sdpa_batched", {})
    if b not in cache:
        cache[b] = _Batched(layout.response_lens[b], q.device)
    return _CpuResponses.apply(q[:, :, r0:r1], k[:, :, a:e], v[:, :, a:e], k[:, :, r0:r1], v[:, :, r0:r1],
                               cache[b], scale)


def sdpa_grouped_attention(query, key, value, layout: GroupLayout, scaling: float, *, path: str = "auto"):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D] (the layout transformers expects back).

    path: "auto" (the CPU flash-kernel path on CPU, the masked path elsewhere), "cpu" or "masked"."""
    if path == "auto":
        path = "cpu" if query.device.type == "cpu" else "masked"
    responses = _cpu_responses if path == "cpu" else _masked_responses
    gqa = query.shape[1] != key.shape[1]
    pieces = []
    for b in range(layout.num_groups):
        a, e = layout.prefix_span(b)
        pieces.append(F.scaled_dot_product_attention(
            query[:, :, a:e], key[:, :, a:e], value[:, :, a:e], is_causal=True, scale=scaling, enable_gqa=gqa))
        pieces.append(responses(query, key, value, layout, b, scaling))
    return torch.cat(pieces, dim=2).transpose(1, 2)
