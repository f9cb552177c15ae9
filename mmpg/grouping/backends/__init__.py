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


BACKENDS = ("sdpa", "flash", "flex", "lse_reference")


def default_backend(device: torch.device) -> str:
    """flash on CUDA when flash-attn imports, else sdpa (exact everywhere)."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash"
        except ImportError:
            return "sdpa"
    return "sdpa"
