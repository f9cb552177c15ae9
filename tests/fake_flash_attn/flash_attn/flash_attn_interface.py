"""Stand-in for flash-attn 2.8.3's `flash_attn.flash_attn_interface` (see ../README.md): same Python signatures and
argument checks, plain-torch kernel on CPU tensors.

Kernel, per segment i (rows cu_q[i]:cu_q[i+1] of q against rows cu_k[i]:cu_k[i+1] of k/v), query head h using key
head h // (Hq / Hk):
    s = scale * q k^T   (float32),  causal: key j visible to query i iff j <= i + (Sk - Sq)  (bottom-right aligned)
    lse = logsumexp_j s (+inf for a row that sees no key),  out = softmax(s) v  (0 for such a row)
Backward with the given (out, lse), as FlashAttention's: dS = P * (dO V^T - rowsum(dO * O)).
"""

from __future__ import annotations

from typing import Optional

import torch

# Tests set this to push float32 through the same call sites; the real kernel refuses float32 (see README).
ALLOW_FP32 = False


def _dtypes_ok() -> tuple[torch.dtype, ...]:
    return (torch.float16, torch.bfloat16, torch.float32) if ALLOW_FP32 else (torch.float16, torch.bfloat16)


def _check_qkv(q, k, v) -> None:
    """The checks of flash-attn's mha_varlen_fwd / mha_varlen_bwd (csrc/flash_attn/flash_api.cpp), same messages."""
    if q.dtype not in _dtypes_ok():
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if v.dtype != q.dtype:
        raise RuntimeError("query and value must have the same dtype")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise RuntimeError(f"Input tensor must have contiguous last dimension ({name})")
        if x.device.type != "cpu":
            raise RuntimeError(f"the flash_attn stand-in runs on CPU tensors only ({name} is on {x.device})")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise RuntimeError(f"varlen q [total_q, H, D], k/v [total_k, Hk, D] expected, got {q.shape}, {k.shape}, "
                           f"{v.shape}")
    head_size = q.shape[-1]
    if head_size > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if head_size % 8:
        raise RuntimeError("query, key, value, and out_padded must have a head_size that is a multiple of 8")
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _check_cu(cu, name: str, total: int) -> None:
    if cu.dtype != torch.int32:
        raise RuntimeError(f"{name} must have dtype int32")
    if not cu.is_contiguous():
        raise RuntimeError(f"{name} must be contiguous")
    if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise RuntimeError(f"{name} must be [batch + 1] cumulative lengths from 0 to {total}")


def _check_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes, **extra) -> None:
    if dropout_p or window_size_left != -1 or window_size_right != -1 or softcap or alibi_slopes is not None:
        raise NotImplementedError("the flash_attn stand-in has no dropout, sliding window, softcap or ALiBi")
    if any(x is not None for x in extra.values()):
        raise NotImplementedError(f"the flash_attn stand-in does not implement {sorted(extra)}")


def _segments(cu_q, cu_k):
    return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())


def _scores(q, k, causal, scale):
    """q [Sq, Hq, D], k [Sk, Hk, D] -> float32 scores [Hq, Sq, Sk], masked entries -inf."""
    rep = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(rep, dim=1)) * scale
    if causal:
        sq, sk = s.shape[1], s.shape[2]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _probs(s, lse):
    """exp(s - lse) with rows of lse = +inf (no visible key) exactly 0."""
    return torch.exp(s - lse[..., None]).nan_to_num(0.0)


def _varlen_forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32)  # [H, total_q]
    rep = q.shape[1] // k.shape[1]
    for a, b, c, d in _segments(cu_seqlens_q, cu_seqlens_k):
        if b == a or d == c:
            continue
        s = _scores(q[a:b], k[c:d], causal, scale)
        seg_lse = torch.logsumexp(s, dim=-1)
        seg_lse = torch.where(torch.isneginf(seg_lse), float("inf"), seg_lse)
        p = _probs(s, seg_lse)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v[c:d].float().repeat_interleave(rep, dim=1))
        lse[:, a:b] = seg_lse
    return out.to(q.dtype), lse


@torch.library.custom_op("mmpg_flash_standin::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def _flash_attn_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out [total_q, H, D] in q's dtype, softmax_lse float32 [H, total_q], S_dmask (empty), rng_state int64 [2])."""
    _check_qkv(q, k, v)
    _check_cu(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    _check_cu(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    _check_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes,
                       block_table=block_table, leftpad_k=leftpad_k, seqused_k=seqused_k)
    if return_softmax:
        raise NotImplementedError("the flash_attn stand-in does not return the softmax")
    out, lse = _varlen_forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return out, lse, torch.empty((0,), dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def _varlen_backward_impl(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    rep, hk = q.shape[1] // k.shape[1], k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    for a, b, c, d in _segments(cu_q, cu_k):
        if b == a or d == c:
            continue
        p = _probs(_scores(q[a:b], k[c:d], causal, scale), lse[:, a:b])  # [Hq, Sq, Sk]
        do, o = dout[a:b].float(), out[a:b].float()  # [Sq, Hq, D]
        vs = v[c:d].float().repeat_interleave(rep, dim=1)
        ks = k[c:d].float().repeat_interleave(rep, dim=1)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vs) - (do * o).sum(-1).transpose(0, 1)[..., None])
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, ks) * scale
        dks = torch.einsum("hqk,qhd->khd", ds, q[a:b].float()) * scale  # [Sk, Hq, D]
        dvs = torch.einsum("hqk,qhd->khd", p, do)
        dk[c:d] += dks.unflatten(1, (hk, rep)).sum(2)
        dv[c:d] += dvs.unflatten(1, (hk, rep)).sum(2)
    return dq, dk, dv


@torch.library.custom_op("mmpg_flash_standin::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
    softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, softcap: float,
    alibi_slopes: Optional[torch.Tensor], deterministic: bool, rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Writes dq, dk, dv in place (as the real one); returns softmax_d float32 [H, total_q + 128 * batch]."""
    _check_qkv(q, k, v)
    _check_cu(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    _check_cu(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    _check_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    if dout.dtype != q.dtype or out.dtype != q.dtype:
        raise RuntimeError("query and dout / out must have the same dtype")
    if dout.stride(-1) != 1 or out.stride(-1) != 1:
        raise RuntimeError("out / dout must have contiguous last dimension")
    if softmax_lse.dtype != torch.float32 or softmax_lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"softmax_lse must be float32 [{q.shape[1]}, {q.shape[0]}], got "
                           f"{softmax_lse.dtype} {tuple(softmax_lse.shape)}")
    grads = _varlen_backward_impl(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    for name, buf, ref, g in (("dq", dq, q, grads[0]), ("dk", dk, k, grads[1]), ("dv", dv, v, grads[2])):
        if buf is None:  # the real C++ allocates a missing buffer and drops it; mmpg always passes one
            continue
        if buf.dtype != ref.dtype or buf.shape != ref.shape or buf.stride(-1) != 1:
            raise RuntimeError(f"{name} must have the dtype and shape of its input and a contiguous last dimension")
        buf.copy_(g)
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [H, total_q]
    batch = cu_seqlens_q.numel() - 1
    return torch.cat([delta, delta.new_zeros(q.shape[1], 128 * batch)], dim=1)


class FlashAttnVarlenFunc(torch.autograd.Function):
    """The autograd wrapper flash_attn_varlen_func uses (what transformers' flash path calls)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        q, k, v = (x.contiguous() if x.stride(-1) != 1 else x for x in (q, k, v))
        out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                    0.0, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_varlen_backward(dout.contiguous(), q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0,
                                    scale, causal, -1, -1, 0.0, None, False, None)
        return dq, dk, dv, None, None, None, None, None, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q [total_q, H, D], k/v [total_k, Hk, D] -> out [total_q, H, D] (2.8.3's signature)."""
    _check_unsupported(dropout_p, window_size[0], window_size[1], softcap, alibi_slopes, block_table=block_table)
    if return_attn_probs:
        raise NotImplementedError("the flash_attn stand-in does not return attention probabilities")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                     scale, causal)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> [B, Sq, H, D]: the batch as equal-length varlen segments."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32)
    out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, sq, sk, dropout_p,
                                 softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                 return_attn_probs)
    return out.unflatten(0, (b, sq))


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("the flash_attn stand-in has no flash_attn_with_kvcache (mmpg never calls it)")
