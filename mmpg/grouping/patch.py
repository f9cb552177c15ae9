"""One patch entry point: `apply_grouped_attention(model)`.

Idempotent, dispatches on `model.config.model_type`, checks the transformers version and the features the grouped
forward calls on the model (signatures, attributes), and only selects the grouped
attention function for the text sub-config (the vision tower keeps its own attention). No modeling code is copied and
no `forward` is replaced: the family adapters in `mmpg.grouping.adapters` call the model's own modules.
"""

from __future__ import annotations

import dataclasses
import inspect

import transformers
from packaging.version import Version

from mmpg.grouping.attention import register_grouped_attention
from mmpg.grouping.backends import BACKENDS
from mmpg.grouping.positions import use_qwen_positions

# model_type -> adapter kind. Tested: tiny Qwen2.5-VL, Qwen3-VL, Qwen2, Qwen3 (tests/test_grouping_*.py).
SUPPORTED_MODEL_TYPES = {"qwen2_5_vl": "vl", "qwen3_vl": "vl", "qwen2": "text", "qwen3": "text"}
# [min, max): the oldest release the version matrix of `scripts/test.sh` runs the equivalence, positions, contract and
# rollout tests on (5.17.0), up to the next major. The version alone is not what mmpg relies
# on: `_check_features` checks what it calls, and the tripwire (`mmpg.grouping.attention`) catches at run time an
# input that a release ignores (docs/grouping.md, "Why 5.17 needed work").
TRANSFORMERS_RANGE = (Version("5.17.0"), Version("6.0.0"))


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers is outside the tested range or lacks a feature the grouped forward calls."""


def _check_transformers(model=None) -> None:
    """The tested version range, then (given a model) the features the grouped forward calls on it."""
    v = Version(transformers.__version__)
    lo, hi = TRANSFORMERS_RANGE
    if not lo <= Version(v.base_version) < hi:
        raise UnsupportedTransformersError(
            f"mmpg.grouping is tested on transformers >={lo},<{hi} (the version matrix of scripts/test.sh); found "
            f"{transformers.__version__}: pip install 'transformers>={lo},<{hi}'")
    if model is not None:
        _check_features(model)


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _check_features(model) -> None:
    """One line per missing feature, naming it and the installed transformers (signature and attribute checks)."""
    if SUPPORTED_MODEL_TYPES.get(getattr(model.config, "model_type", None)) != "vl":
        return
    inner = model.model
    needs = [
        ("forward", {"pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw", "position_ids"},
         "takes the visual inputs and explicit position_ids"),
        ("get_rope_index", {"input_ids", "mm_token_type_ids"}, "takes mm_token_type_ids (the 3-D mRoPE index)"),
    ]
    if model.config.model_type == "qwen2_5_vl":
        needs.append(("get_vision_position_ids", {"start_position", "grid_thw", "spatial_merge_size"},
                      "gives one video's vision positions (the trained-convention index, mmpg.grouping.positions)"))
    for name, params, what in needs:
        fn = getattr(inner, name, None)
        if fn is None or not params <= _params(fn):
            missing = sorted(params - _params(fn)) if fn is not None else []
            raise UnsupportedTransformersError(
                f"transformers {transformers.__version__}: {type(inner).__name__}.{name} no longer {what}"
                f"{' (no ' + ', '.join(missing) + ')' if missing else ' (not found)'}; mmpg's grouped forward needs "
                f"it (tested: transformers >={TRANSFORMERS_RANGE[0]},<{TRANSFORMERS_RANGE[1]})")


def base_model(model):
    """The transformers model under a peft `PeftModel` shell, any other model as it is. (A PeftModel forwards
    attribute reads to its tuner, whose `.model` is the ForConditionalGeneration, so `model.model` would not be the
    inner Qwen model the adapters call. peft's LoRA wrappers sit inside the transformers model, so the unwrapped
    model still runs them; mmpg's trainer hands the transformers model itself, `mmpg.models.lora`.)"""
    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def model_kind(model) -> str:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"grouped forward does not support model_type {model_type!r} ({type(model).__name__}); "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    return SUPPORTED_MODEL_TYPES[model_type]


def _check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")


@dataclasses.dataclass
class GroupingState:
    """The grouped forward's own settings on a model, the one object mmpg keeps there (`grouping_state`).

    backend: "auto" (resolved per call from the device and dtype) or a `BACKENDS` name, read at each grouped forward
    and shared prefill; deterministic: deterministic attention backward where the backend has a choice;
    sequence_group: the process group over which each packed row is spread (None: one rank); kernel_dtype: the
    dtype the grouped attention's kernel runs in when it differs from the run's (`mmpg.grouping.precise`); checked:
    the transformers features were checked on this model."""

    backend: str = "auto"
    deterministic: bool = False
    sequence_group: object = None
    kernel_dtype: object = None
    checked: bool = False


def grouping_state(model) -> GroupingState:
    """The `GroupingState` of `model` (a peft model: the transformers model inside), made on first use."""
    inner = base_model(model)
    state = inner.__dict__.get("mmpg_grouping")
    if state is None:
        state = GroupingState()
        object.__setattr__(inner, "mmpg_grouping", state)  # a plain attribute, not a registered submodule
    return state


def set_grouping_options(model, backend: str | None = None, deterministic: bool | None = None):
    """Record the grouped forward's backend ("auto", "sdpa", ...) and its deterministic-backward flag in the model's
    `GroupingState`, without patching its attention: the first grouped forward does that, so a run that never takes
    the grouped path keeps its own attention untouched. None leaves a setting as it is. Returns the model."""
    state = grouping_state(model)
    if backend is not None:
        _check_backend_name(backend)
        state.backend = backend
    if deterministic is not None:
        state.deterministic = bool(deterministic)
    return model


def apply_grouped_attention(model, backend: str | None = None, sequence_group=None, deterministic: bool | None = None):
    """Select the grouped attention for the text model, put Qwen2.5-VL on its trained mRoPE convention
    (`mmpg.grouping.positions`) and remember the backend. Safe to call again (it then only changes the backend when
    one is given). `sequence_group`: a process group of sp ranks over which `grouped_logprobs` spreads each packed
    row from now on (`mmpg.grouping.sequence`). `deterministic`: deterministic attention backward kernels where the
    backend has a choice (flash-attn's `deterministic=`), from now on. Returns the model."""
    if backend is not None:
        _check_backend_name(backend)
    set_grouping_options(model, backend=backend, deterministic=deterministic)
    state = grouping_state(model)
    model_kind(model)
    if sequence_group is not None:
        state.sequence_group = sequence_group
    if not state.checked:
        _check_transformers(model)
        state.checked = True
    use_qwen_positions(model)
    text_config = model.config.get_text_config()
    current = text_config._attn_implementation or "eager"
    name = register_grouped_attention(current)
    if current != name:
        if text_config is model.config:
            model.set_attn_implementation(name)
        else:
            model.set_attn_implementation({"text_config": name})
    return model
