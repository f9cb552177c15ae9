"""The grouped attention function, registered through transformers' `AttentionInterface`.

One function is registered per base implementation the model was loaded with (`mmpg_grouped_sdpa`,
`mmpg_grouped_eager`, `mmpg_grouped_flash_attention_2`, ...). It behaves exactly like the base implementation
unless the layer call carries `mmpg_layout=<GroupLayout>` in its kwargs — which only `grouped_logprobs` passes — and
then it runs the grouped backend named by the layout. So a patched model still generates and trains normally, and
the layout reaches every layer (also the recomputation under gradient checkpointing, which replays layer kwargs).
The same base's mask function is registered under the new name, so ordinary calls build the masks they always did.
"""

from __future__ import annotations

import sys

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mmpg.grouping.backends import get_backend

PREFIX = "mmpg_grouped_"
# Handed to the text model as its `attention_mask` during a grouped forward: a 4-D tensor is passed through mask
# creation untouched by every Qwen text model, and the grouped attention ignores it (the layout is the mask).
LAYOUT_KWARG = "mmpg_layout"


def _ordinary(base: str) -> str:
    """The implementation ordinary calls use. transformers' flash path looks its kernel up by the configured name,
    which is ours after patching, so a flash-loaded model runs its ordinary forward (and `generate`) with sdpa; the
    grouped forward still uses flash-attn directly (backend "flash")."""
    return "sdpa" if "flash" in base else base


def _base_attention(base: str, module):
    base = _ordinary(base)
    if base == "eager":
        # eager lives in each modeling file, not in the registry
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


def _make_attention(base: str):
    def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layout = kwargs.pop(LAYOUT_KWARG, None)
        if layout is None:
            return _base_attention(base, module)(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if dropout:
            raise ValueError("grouped attention is exact only without attention dropout; set attention_dropout=0")
        if kwargs.get("sliding_window") is not None:
            raise ValueError("grouped attention does not support sliding-window layers (use_sliding_window=False)")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return get_backend(layout.backend)(query, key, value, layout, scale), None

    grouped_attention.__name__ = f"{PREFIX}{base}"
    return grouped_attention


def register_grouped_attention(base: str) -> str:
    """Register (once) the grouped function wrapping `base`; returns its registry name."""
    if base.startswith(PREFIX):
        return base
    name = PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"attention implementation {base!r} is not registered in transformers")
        AttentionInterface.register(name, _make_attention(base))
        ordinary = _ordinary(base)
        mask = ALL_MASK_ATTENTION_FUNCTIONS[ordinary] if ordinary in ALL_MASK_ATTENTION_FUNCTIONS else (
            eager_mask if ordinary == "eager" else sdpa_mask)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
    return name
