"""Attention kernels that also return the log-sum-exp, for the two parts of cascade decoding.

    attend(q [B, H, Lq, D], k/v [B, H, Lk, D], key_mask [B, Lk] bool or None, scale, backend)
        -> (out [B, H, Lq, D] in q's dtype, lse [B, H, Lq] float32)

Queries and keys have the same head count: the caller folds GQA's query heads into Lq. `key_mask` marks the real keys
of a left-padded prefix batch (True = attend); every query row has at least one real key. Backends:

    sdpa   torch's own kernels. CPU: `_scaled_dot_product_flash_attention_for_cpu` (returns the LSE; tested).
           CUDA: `_scaled_dot_product_efficient_attention(compute_log_sumexp=True)` (UNTESTED on a GPU; see
           tests/test_cascade_gpu.py)
    flash  flash-attn 2.6+ `flash_attn_with_kvcache(..., cache_leftpad=, return_softmax_lse=True)`, CUDA fp16/bf16
           (UNTESTED on a GPU; see tests/test_cascade_gpu.py)
    math   float32 (float64 for float64 inputs) matmul + logsumexp on any device; the reference in tests, and the
           last kernel of the chain before copy decoding

"auto" is chosen per run by `mmpg.rollout.decode_choice` (CUDA: flash if usable, else sdpa, else math, each checked
against copy decoding on the run's batches); `resolve_cascade_kernel` alone maps it to sdpa.
"""

from __future__ import annotations

import torch

CASCADE_KERNELS = ("auto", "sdpa", "flash", "math")  # rollout.cascade_backend

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def resolve_cascade_kernel(name: str, device: torch.device) -> str:
    """"auto" -> sdpa (torch's own kernel with its LSE: the CPU flash kernel, or CUDA's memory-efficient one); the
    per-run choice with its check is `mmpg.rollout.decode_choice`. Others as given."""
    if name not in CASCADE_KERNELS:
        raise ValueError(f"unknown cascade attention backend {name!r}; choose one of {', '.join(CASCADE_KERNELS)}")
    return "sdpa" if name == "auto" else name


def attend(q, k, v, key_mask, scale: float, backend: str):
    kernel = KERNELS.get(backend)
    if kernel is None:
        raise ValueError(f"unknown cascade attention backend {backend!r}")
    return kernel(q, k, v, key_mask, scale)


def _sdpa(q, k, v, key_mask, scale):
    if q.device.type == "cpu":
        mask = None  # the CPU kernel takes an additive mask of q's dtype: [B, 1, 1, Lk], -inf on padding
        if key_mask is not None:
            mask = q.new_zeros(key_mask.shape).masked_fill_(~key_mask, float("-inf"))[:, None, None, :]
        out, lse = _flash_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse.float()
    return _cuda_efficient(q, k, v, key_mask, scale)


def _math(q, k, v, key_mask, scale):
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, Lq]
    out = torch.matmul(torch.exp(s - lse[..., None]), v.to(acc))
    return out.to(q.dtype), lse


def key_bias(key_mask: torch.Tensor, dtype: torch.dtype, heads: int, lq: int) -> torch.Tensor:
    """key_mask [B, Lk] bool (True: attend) -> additive bias [B, H, Lq, Lk] of `dtype` (0 or -inf) for torch's
    memory-efficient kernel, built as torch's own SDPA builds it (`preprocess_mask` in ATen's attention.cpp): one row
    per batch row, its last dim padded to a multiple of 16 in storage and sliced back (the kernel wants aligned row
    strides), then expanded over heads and queries with stride 0 (the kernel reads the bias through its strides).

    Memory: B·ceil16(Lk)·s bytes per call instead of the B·H·Lq·ceil16(Lk)·s of a materialised bias (H·Lq times
    less). At the released 7B geometry (H = 4 key-value heads, Lq = G·rep = 8·7 = 56 rows of a prompt folded into the
    query length, bf16) and P = 16k: 32 KB instead of 7.3 MB per prompt, per layer and decode step."""
    b, lk = key_mask.shape
    padded = (lk + 15) // 16 * 16
    bias = torch.zeros(b, 1, 1, padded, dtype=dtype, device=key_mask.device)[..., :lk]
    bias.masked_fill_(~key_mask[:, None, None, :], float("-inf"))
    return bias.expand(b, heads, lq, lk)


def _cuda_efficient(q, k, v, key_mask, scale):
    """UNTESTED on a GPU (tests/test_cascade_gpu.py). The memory-efficient kernel takes an additive bias
    (`key_bias`: one broadcast row per batch row); its LSE comes padded along Lq (to 32) and is sliced."""
    bias = None if key_mask is None else key_bias(key_mask, q.dtype, q.shape[1], q.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=scale)[:2]
    return out, lse[..., : q.shape[2]].float()


def _flash(q, k, v, key_mask, scale):
    """UNTESTED on a GPU. flash-attn's layout is [B, L, H, D]; the left padding of a prefix batch is its
    `cache_leftpad` (keys [leftpad, Lk) of each batch row are attended)."""
    from flash_attn import flash_attn_with_kvcache

    B, _, _, _ = q.shape
    Lk = k.shape[2]
    seqlens = torch.full((B,), Lk, dtype=torch.int32, device=q.device)
    leftpad = None if key_mask is None else (~key_mask).sum(dim=1).to(torch.int32)
    out, lse = flash_attn_with_kvcache(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=seqlens, cache_leftpad=leftpad,
        softmax_scale=scale, causal=False, return_softmax_lse=True)
    return out.transpose(1, 2), lse.float()  # [B, H, Lq, D], [B, H, Lq]


# backend name -> kernel (q, k, v, key_mask, scale) -> (out, lse); tests swap one in to inject a fault
KERNELS = {"sdpa": _sdpa, "flash": _flash, "math": _math}
