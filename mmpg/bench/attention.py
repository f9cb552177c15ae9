"""Attention-level variants: one attention layer's forward + backward for one prompt of P tokens and G responses.

    naive     batched causal SDPA over G copies of [prefix | response]: q, k, v [G, H, P+S, D]
    upstream  the PyPI package `prefix_grouper` (0.0.1.post1): `PrefixGrouper.forward(attn_fn, q, k, v)` on the packed
              row [1, H, P+G·S, D], with `attn_fn` an SDPA call (below). It gathers prefix and suffixes into padded
              tensors and, for the suffix call, repeats the prefix K/V once per response (`batch_repeat_cat`).
    mmpg      `mmpg.grouping.backends.get_backend(name)` on a `GroupLayout` over the same packed row; no K/V copy.

Every variant builds its per-forward metadata (the `PrefixGrouper`, the `GroupLayout`) inside the step, since in a
model both are built once per forward; their cost is small. The step is `out.sum().backward()` (a broadcast
gradient, so no variant pays for a gradient tensor of its output's size). Peak memory counts the inputs too (the
naive variant's q, k, v are G-fold), since in a model they are activations of the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func

        return flash_attn_func
    except ImportError:
        return None


def upstream_sdpa(q, k, v, attn_mask, *args, scaling=None, **kwargs):
    """The attention function handed to `PrefixGrouper.forward`: q [b, Hq, Lq, D], k/v [b, Hkv, Lk, D],
    attn_mask [b, Lk] bool (True = a real key) -> [b, Lq, Hq, D].

    The package aligns queries to the end of the keys (suffix queries follow the prefix keys), so the causal rule is
    bottom-right: query i sees key j iff j <= i + Lk - Lq. FlashAttention does this by itself, and is used when it
    imports, the tensors are on a GPU and nothing is padded (the package's own recommended setup); SDPA needs the
    mask spelled out."""
    gqa = q.shape[1] != k.shape[1]
    Lq, Lk = q.shape[2], k.shape[2]
    unpadded = bool(attn_mask.all())
    if unpadded and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_attn_func() is not None:
        return _flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scaling,
                                  causal=True)
    if Lq == Lk and unpadded:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2)
    i = torch.arange(Lq, device=q.device)[:, None]
    j = torch.arange(Lk, device=q.device)[None, :]
    mask = (j <= i + (Lk - Lq))[None, None]  # [1, 1, Lq, Lk]
    if not unpadded:
        mask = mask & attn_mask[:, None, None, :]
        mask = mask | ~mask.any(-1, keepdim=True)  # padded queries with no key: any value, they are dropped
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)


def setup(case: dict, device: torch.device):
    """(prepare, step, info) for one variant. `prepare()` allocates q, k, v (inside the memory window: the naive
    variant's G-fold inputs are part of its cost); `step()` runs forward + backward on them."""
    P, S, G = case["P"], case["S"], case["G"]
    H, Hkv, D = case["heads"], case["kv_heads"], case["head_dim"]
    dtype = getattr(torch, case.get("dtype", "float32"))
    variant = case["variant"]
    scale = D ** -0.5
    rows, length = (G, P + S) if variant == "naive" else (1, P + G * S)
    qkv: list[torch.Tensor] = []

    def prepare():
        gen = torch.Generator(device=device).manual_seed(0)
        qkv[:] = [torch.randn(rows, h, length, D, generator=gen, device=device, dtype=dtype).requires_grad_()
                  for h in (H, Hkv, Hkv)]

    if variant == "naive":
        def forward(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=H != Hkv)
    elif variant == "upstream":
        from prefix_grouper import PrefixGrouper

        def forward(q, k, v):
            grouper = PrefixGrouper([[P] + [S] * G], device=device)
            return grouper.forward(upstream_sdpa, q, k, v, scaling=scale)
    else:
        from mmpg.grouping import GroupLayout
        from mmpg.grouping.backends import get_backend

        backend = case.get("backend") or "sdpa"
        fn = get_backend(backend)

        def forward(q, k, v):
            layout = GroupLayout([P], [[S] * G], device, backend)
            return fn(q, k, v, layout, scale)

    def step():
        for t in qkv:
            t.grad = None
        forward(*qkv).sum().backward()

    return prepare, step, {"tokens": rows * length}
