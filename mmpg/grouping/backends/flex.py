"""`flex` backend: FlexAttention over the packed row with a block mask (compiled with dynamic shapes).

mask_mod(q, kv) = same group  and  kv <= q  and  (kv is a prefix token  or  kv is in q's own response).
Blocks that are fully masked (other groups, other responses) are skipped by the kernel, so the cost tracks the ideal
attention FLOPs up to block granularity. On CPU only the forward runs (FlexAttention has no CPU backward).

Length buckets. Every packed row has its own length T, and a compiled kernel is specialised on shape facts such as
"T is a multiple of the 128-token block", so raw lengths can make torch.compile compile again and again. The row is
padded (q, k, v only, inside this function) to `bucket_length(T)`: T rounded up to a multiple of
max(128, 2^(ceil(log2 T) - 3)) — a multiple of the block size, four buckets per doubling of T, fewer than 128
extra tokens up to T = 1024 and at most 25% more above. The padded tokens are their own causal group (group id -1, response
id -2): no real token sees them, and they see only each other, so the real rows' output is exactly the unpadded one;
their blocks sit on the diagonal and cost one block row each. Compiles are counted (`compile_stats`): one info line
when a call compiles something new (a new bucket, or the first dynamic-shape graph).
"""

from __future__ import annotations

import functools
import logging

import torch

from mmpg.grouping.layout import GroupLayout

log = logging.getLogger("mmpg.grouping")

BLOCK = 128  # FlexAttention's default block size (queries and keys)
_stats = {"compiles": 0, "buckets": set()}


def bucket_length(total: int) -> int:
    """The padded packed length flex runs at for a row of `total` tokens (module docstring): 1..128 -> 128,
    129..256 -> 256, 300 -> 384, 1000 -> 1024, 5000 -> 5120, 70000 -> 81920."""
    if total < 1:
        raise ValueError(f"packed length {total} < 1")
    step = max(BLOCK, 1 << max(0, (total - 1).bit_length() - 3))
    return -(-total // step) * step


def compile_stats() -> dict:
    """{"compiles": calls that compiled something, "buckets": sorted padded lengths used} in this process."""
    return {"compiles": _stats["compiles"], "buckets": sorted(_stats["buckets"])}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _labels(layout: GroupLayout, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[padded] group and response ids; the padding is group -1, response -2 (module docstring)."""
    group, resp = layout.token_labels()
    extra = padded - layout.total
    if extra:
        group = torch.cat([group, group.new_full((extra,), -1)])
        resp = torch.cat([resp, resp.new_full((extra,), -2)])
    return group, resp


def block_mask(layout: GroupLayout):
    """The layout's block mask at its bucket length (cached on the layout: every layer of a forward reuses it)."""
    cached = layout.__dict__.get("_flex_block_mask")
    if cached is not None:
        return cached
    padded = bucket_length(layout.total)
    group, resp = _labels(layout, padded)

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (resp[kv_idx] == -1) | (resp[kv_idx] == resp[q_idx])
        return (group[q_idx] == group[kv_idx]) & (kv_idx <= q_idx) & visible

    mask = _compiled_create_block_mask()(mask_mod, B=None, H=None, Q_LEN=padded, KV_LEN=padded,
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
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D] (run at the bucket length, cut back to T)."""
    total, before = layout.total, _graphs()
    padded = bucket_length(total)
    mask = block_mask(layout)
    if padded != total:
        query, key, value = (torch.nn.functional.pad(x, (0, 0, 0, padded - total)) for x in (query, key, value))
    out = _compiled_flex()(query, key, value, block_mask=mask, scale=scaling,
                           enable_gqa=query.shape[1] != key.shape[1])
    new = padded not in _stats["buckets"]
    _stats["buckets"].add(padded)
    if _graphs() > before:
        _stats["compiles"] += 1
        log.info("flex: compiled for packed length %d (bucket %d%s); %d compile(s), %d bucket(s) so far", total,
                 padded, ", new" if new else "", _stats["compiles"], len(_stats["buckets"]))
    return out[:, :, :total].transpose(1, 2)
