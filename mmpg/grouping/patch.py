"""One patch entry point: `apply_grouped_attention(model)`.

Idempotent, dispatches on `model.config.model_type`, checks the transformers version, and only selects the grouped
attention function for the text sub-config (the vision tower keeps its own attention). No modeling code is copied and
no `forward` is replaced: the family adapters in `mmpg.grouping.adapters` call the model's own modules.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

from mmpg.grouping.attention import register_grouped_attention
from mmpg.grouping.backends import BACKENDS
from mmpg.grouping.positions import use_qwen_positions

# model_type -> adapter kind. Tested: tiny Qwen2.5-VL, Qwen3-VL, Qwen2, Qwen3 (tests/test_grouping_*.py).
SUPPORTED_MODEL_TYPES = {"qwen2_5_vl": "vl", "qwen3_vl": "vl", "qwen2": "text", "qwen3": "text"}
# [min, max). The minimum is the oldest version the equivalence tests passed on: under transformers 5.17 the grouped
# Qwen2.5-VL forward differs from the repeated one by up to 0.04 (CPU) / 0.27 (GPU) in logprobs (seen 2026-11-30 on a
# GPU machine whose image carries 5.17), so older 5.x releases are refused rather than silently wrong.
TRANSFORMERS_RANGE = (Version("5.24.0"), Version("6.0.0"))


def _check_transformers() -> None:
    v = Version(transformers.__version__)
    lo, hi = TRANSFORMERS_RANGE
    if not lo <= Version(v.base_version) < hi:
        raise RuntimeError(f"mmpg.grouping supports transformers >={lo},<{hi}; found {transformers.__version__}")


def model_kind(model) -> str:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"grouped forward does not support model_type {model_type!r} ({type(model).__name__}); "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    return SUPPORTED_MODEL_TYPES[model_type]


def apply_grouped_attention(model, backend: str | None = None):
    """Select the grouped attention for the text model, put Qwen2.5-VL on its trained mRoPE convention
    (`mmpg.grouping.positions`) and remember the backend. Safe to call again (it then only changes the backend when
    one is given). Returns the model."""
    _check_transformers()
    model_kind(model)
    use_qwen_positions(model)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown grouped attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    text_config = model.config.get_text_config()
    current = text_config._attn_implementation or "eager"
    name = register_grouped_attention(current)
    if current != name:
        if text_config is model.config:
            model.set_attn_implementation(name)
        else:
            model.set_attn_implementation({"text_config": name})
    if backend is not None or not hasattr(model, "_mmpg_backend"):
        model._mmpg_backend = backend or "auto"  # "auto" is resolved per call from the device and dtype
    return model
