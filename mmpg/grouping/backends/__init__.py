"""Grouped attention backends. Each maps (query [1, Hq, T, D], key/value [1, Hkv, T, D], layout, scale) to the
attention output [1, T, Hq, D] under the layout's rule; see `mmpg.grouping.layout`."""

from __future__ import annotations

import torch


def get_backend(name: str):
    if name == "sdpa":
        from mmpg.grouping.backends.sdpa import sdpa_grouped_attention

        return sdpa_grouped_attention
    if name == "flash":
        from mmpg.grouping.backends.varlen import flash_grouped_attention

        return flash_grouped_attention
    if name == "lse_reference":
        from mmpg.grouping.backends.varlen import reference_grouped_attention

        return reference_grouped_attention
    if name == "flex":
        from mmpg.grouping.backends.flex import flex_grouped_attention

        return flex_grouped_attention
    raise ValueError(f"unknown grouped attention backend {name!r}; choose sdpa, flash, flex or lse_reference")


BACKENDS = ("auto", "sdpa", "flash", "flex", "lse_reference")


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" -> flash on CUDA in fp16/bf16 when flash-attn imports, else sdpa (exact everywhere). Resolved at each
    call, so a model patched on the CPU and moved to a GPU (or cast) gets the right one."""
    if name != "auto":
        return name
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        try:
            import flash_attn  # noqa: F401

            return "flash"
        except ImportError:
            pass
    return "sdpa"
