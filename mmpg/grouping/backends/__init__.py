"""Grouped attention backends. Each maps (query [1, Hq, T, D], key/value [1, Hkv, T, D] of one dtype, layout on their
device, scale) to the attention output [1, T, Hq, D] under the layout's rule; see `mmpg.grouping.layout`."""

from __future__ import annotations

import torch

from mmpg.grouping.backends.probe import flash_status


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


def compute_dtype(model, device: torch.device) -> torch.dtype:
    """The dtype attention will run in: the autocast dtype when autocast is on for the device (fp32 weights under
    bf16 autocast attend in bf16, see `mmpg.grouping.attention.attention_dtype`), else the weights' dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return model.get_input_embeddings().weight.dtype


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" -> flash on CUDA in fp16/bf16 when a usable flash-attn is installed (`probe.flash_status`: version,
    GPU generation, a kernel for this GPU), else sdpa (exact everywhere). Resolved at each call, so a model patched on
    the CPU and moved to a GPU (or cast, or run under autocast) gets the right one."""
    if name != "auto":
        return name
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_status(device)[0]:
        return "flash"
    return "sdpa"
