"""The grouped attention function, registered through transformers' `AttentionInterface`.

One function is registered per base implementation the model was loaded with (`mmpg_grouped_sdpa`,
`mmpg_grouped_eager`, `mmpg_grouped_fa2` for `flash_attention_2`, ...), with the base's mask function under the same
name. The names never contain "flash": transformers takes any such name for a flash kernel, tries to load it and
switches generation and mask code to flash conventions. The function behaves exactly like the base implementation
unless the layer call carries `mmpg_layout=<GroupLayout>` in its kwargs (only `grouped_logprobs` passes it), and
then runs the grouped backend the layout names; so a patched model still generates and trains normally, and the
layout reaches every layer, also the recomputation under gradient checkpointing, which replays layer kwargs.

The tripwire: transformers passes unknown keyword arguments of a model's forward silently down to the attention
function. An input mmpg hands the forward for the model to consume (`GroupLayout.model_inputs`: the visual inputs)
that arrives here was ignored by the model, which would then run without it (docs/grouping.md), so the grouped call
raises at once, naming the key and the transformers version. It checks only the keys mmpg itself passed, never an
allow-list of transformers' own kwargs (those change between releases), at one dict lookup per key and layer.

Before the backend runs, q/k/v are brought to one dtype (`attention_dtype`), and the layout to the layer's device
(`GroupLayout.for_device`: a model spread over several GPUs with `device_map` hands each layer its own copy).
"""

from __future__ import annotations

import re
import sys

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mmpg.grouping.backends import get_backend
from mmpg.grouping.ulysses import ulysses_attention

PREFIX = "mmpg_grouped_"
# Handed to the text model as its `attention_mask` during a grouped forward: a 4-D tensor is passed through mask
# creation untouched by every Qwen text model, and the grouped attention ignores it (the layout is the mask).
LAYOUT_KWARG = "mmpg_layout"


def grouped_name(base: str) -> str:
    """Registry name of the grouped function wrapping `base`, without "flash" in it (module docstring):
    flash_attention_2 -> mmpg_grouped_fa2, kernels-community/flash-attn3 -> mmpg_grouped_kernels-community_fa3."""
    if base.startswith(PREFIX):
        return base
    return PREFIX + re.sub(r"flash[_-]?(attention|attn)?[_-]?", "fa", base).replace("/", "_").replace(":", "_")


def attention_dtype(module, query, key, value) -> torch.dtype:
    """The one dtype q/k/v go to the backend in, chosen as transformers' own flash wrapper chooses it: under autocast
    the autocast dtype (fp32 weights under bf16 autocast give bf16 projections, and fp32 q/k once multiplied by the
    fp32 rotary tables, while v stays bf16); otherwise their common dtype, or, if they differ, the dtype of the
    layer's projections. flash-attn refuses mixed dtypes, and FlexAttention's backward refuses them too."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if query.dtype == key.dtype == value.dtype:
        return query.dtype
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    return linear.weight.dtype if linear is not None else value.dtype


def _ordinary(base: str) -> str:
    """The implementation ordinary calls use. transformers' flash path looks its kernel up by the configured name,
    which is ours after patching, so a flash-loaded model runs its ordinary forward (and `generate`) with sdpa; the
    grouped forward still uses flash-attn directly (backend "flash")."""
    return "sdpa" if "flash" in base else base


def base_attention(base: str, module):
    base = _ordinary(base)
    if base == "eager":
        # eager lives in each modeling file, not in the registry
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


class IgnoredInputError(RuntimeError):
    """An input handed to the model's forward reached the attention function: the model did not consume it."""


def check_tripwire(passed: tuple[str, ...], kwargs: dict, module, where: str) -> None:
    """Raise `IgnoredInputError` if one of the keys mmpg passed to the forward (`passed`) is in the attention kwargs."""
    ignored = [k for k in passed if k in kwargs]
    if ignored:
        raise IgnoredInputError(
            f"{where}: {', '.join(ignored)} handed to the model's forward reached the attention function of "
            f"{type(module).__name__}: transformers {transformers.__version__} does not consume it there, so the "
            "forward would silently run without it; use a transformers release mmpg supports (README: Tests)")


def _make_attention(base: str):
    def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layout = kwargs.pop(LAYOUT_KWARG, None)
        if layout is None:
            return base_attention(base, module)(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        check_tripwire(layout.model_inputs, kwargs, module, "grouped forward")
        if dropout:
            raise ValueError("grouped attention is exact only without attention dropout; set attention_dropout=0")
        if kwargs.get("sliding_window") is not None:
            raise ValueError("grouped attention does not support sliding-window layers (use_sliding_window=False)")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        dtype = layout.kernel_dtype or attention_dtype(module, query, key, value)
        query, key, value = (x.to(dtype) for x in (query, key, value))
        layout = layout.for_device(query.device)
        if layout.sequence is not None:  # this rank holds a shard of the row: Ulysses around the same backend
            return ulysses_attention(get_backend(layout.backend), query, key, value, layout, scale), None
        return get_backend(layout.backend)(query, key, value, layout, scale), None

    grouped_attention.__name__ = grouped_name(base).replace("-", "_")
    return grouped_attention


def register_wrapping(name: str, base: str, make) -> str:
    """Register (once) under `name` the attention function `make(base)` that wraps `base`, with the mask function the
    ordinary calls of `base` consume (`_ordinary`: sdpa's for a flash-loaded model); returns `name`. The grouped
    forward's functions and cascade decoding's (`mmpg.rollout.cascade_attention`) are registered through it."""
    if name not in ALL_ATTENTION_FUNCTIONS:
        if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"attention implementation {base!r} is not registered in transformers")
        AttentionInterface.register(name, make(base))
        ordinary = _ordinary(base)
        mask = ALL_MASK_ATTENTION_FUNCTIONS[ordinary] if ordinary in ALL_MASK_ATTENTION_FUNCTIONS else (
            eager_mask if ordinary == "eager" else sdpa_mask)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
    return name


def register_grouped_attention(base: str) -> str:
    """Register (once) the grouped function wrapping `base`; returns its registry name."""
    if base.startswith(PREFIX):
        return base
    return register_wrapping(grouped_name(base), base, _make_attention)
