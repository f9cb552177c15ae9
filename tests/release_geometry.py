"""Attention at the released models' head geometry, for the GPU checks and their CPU counterparts.

Released shapes (public configs): head_dim 128; Qwen2.5-VL-7B 28 query / 4 key-value heads (GQA 7), Qwen3-VL-8B
32 / 8 (GQA 4). The tiny test models have head_dim 16 and GQA 2, which leaves a kernel's head-size and GQA-ratio
branches unexercised; these cases put the grouped backends and the cascade kernels through the released ones.

    grouped   q [1, Hq, T, D], k/v [1, Hkv, T, D] under LAYOUT      -> out [1, T, Hq, D]   vs dense rule, float64
    cascade   q [B, Hkv, G*rep, D] (GQA folded into Lq), k/v [B, Hkv, Lk, D], left padding -> (out, lse) vs math
"""

from __future__ import annotations

import torch

from mmpg.models.geometry import MODELS

# name -> (query heads, key-value heads, head_dim), from the released configs' presets (mmpg.models.geometry)
GEOMETRIES = {name: (MODELS[m].heads, MODELS[m].kv_heads, MODELS[m].d)
              for name, m in (("gqa7", "qwen2.5-vl-7b"), ("gqa4", "qwen3-vl-8b"))}
assert GEOMETRIES == {"gqa7": (28, 4, 128), "gqa4": (32, 8, 128)}
# a long and a short prompt; unequal responses, one of length 1 (flash's max_seqlen_q = 1 branch)
LAYOUT = ([300, 77], [[40, 1, 129, 60], [5, 33]])
SHORT_LAYOUT = ([96, 23], [[12, 1, 40, 9], [5, 17]])  # the same structure, a tenth of the work: for the CPU
SCALE = 128 ** -0.5


def grouped_qkv(layout, geometry: str, dtype, device, seed: int = 0):
    hq, hkv, d = GEOMETRIES[geometry]
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(1, h, layout.total, d, generator=g, device=device, dtype=torch.float32).to(dtype)
            .requires_grad_() for h in (hq, hkv, hkv)]


def dense_grouped(q, k, v, layout):
    """[1, T, Hq, D] float64: attention under the layout's rule (`GroupLayout.dense_mask`), GQA by head repeat."""
    rep = q.shape[1] // k.shape[1]
    k64, v64 = (x.double().repeat_interleave(rep, 1) for x in (k, v))
    s = q.double() @ k64.transpose(-1, -2) * SCALE
    s = s.masked_fill(~layout.dense_mask().to(q.device), float("-inf"))
    return (s.softmax(-1) @ v64).transpose(1, 2)


def compare_grouped(backend: str, geometry: str, dtype, device, lens=LAYOUT) -> tuple[float, dict[str, float]]:
    """(max |out - dense|, relative gradient difference of q, k and v) of one grouped backend ("sdpa:masked": the
    sdpa backend's masked path on any device). The gradient is of sum(out * w) for a fixed random w, so every entry
    gets its own signal."""
    from mmpg.grouping import GroupLayout
    from mmpg.grouping.backends import get_backend

    layout = GroupLayout(*lens, torch.device(device), backend=backend.split(":")[0])
    q, k, v = grouped_qkv(layout, geometry, dtype, device)
    if backend == "sdpa:masked":  # the masked path, which "auto" takes off the CPU
        from mmpg.grouping.backends.sdpa import sdpa_grouped_attention

        out = sdpa_grouped_attention(q, k, v, layout, SCALE, path="masked")
    else:
        out = get_backend(backend)(q, k, v, layout, SCALE)
    ref = dense_grouped(q, k, v, layout)
    w = torch.randn(out.shape, generator=torch.Generator(device=device).manual_seed(1), device=device)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), (q, k, v))
    rel = {n: float((a.double() - b.double()).norm() / b.double().norm()) for n, a, b in zip("qkv", grads, ref_grads)}
    return float((out.detach().double() - ref.detach()).abs().max()), rel


def cascade_qkv(geometry: str, dtype, device, group: int, prefix: int, seed: int = 0):
    """A prefix block of cascade decoding: B 3 prompts, `group` rows each, GQA folded into the query length."""
    hq, hkv, d = GEOMETRIES[geometry]
    g = torch.Generator(device=device).manual_seed(seed)
    lq = group * (hq // hkv)
    q, k, v = (torch.randn(3, hkv, n, d, generator=g, device=device, dtype=torch.float32).to(dtype)
               for n in (lq, prefix, prefix))
    pad = torch.tensor([0, prefix // 16, prefix * 5 // 6], device=device)  # left padding per prompt, < prefix
    mask = torch.arange(prefix, device=device)[None, :] >= pad[:, None]
    return q, k, v, mask


def compare_cascade(backend: str, geometry: str, dtype, device, padded: bool, group: int = 16, prefix: int = 300
                    ) -> tuple[float, float]:
    """(max |out - math|, max |lse - math lse|) of one cascade kernel against the float32 math kernel (prefix 300:
    not a multiple of 16, the memory-efficient kernel's bias alignment)."""
    from mmpg.rollout.cascade_kernels import attend

    q, k, v, mask = cascade_qkv(geometry, dtype, device, group, prefix)
    mask = mask if padded else None
    out, lse = attend(q, k, v, mask, SCALE, backend)
    ref, ref_lse = attend(q.float(), k.float(), v.float(), mask, SCALE, "math")
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    return float((out.float() - ref).abs().max()), float((lse - ref_lse).abs().max())
