"""Loading policies and processors the way a real checkpoint is loaded (`from_pretrained`), tiny or not."""

from __future__ import annotations

from pathlib import Path

import torch

from mmpg.errors import UserError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _check_local(path: str | Path) -> None:
    p = Path(path)
    if (p.exists() or str(path).startswith((".", "/"))) and not (p / "config.json").is_file():
        raise UserError(f"{path}: no config.json here; point at a checkpoint folder (mmpg make-tiny builds one)")


def load_processor(path: str | Path):
    """The checkpoint's processor (VL families) or tokenizer (text families)."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    _check_local(path)
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "vision_config"):
        return AutoProcessor.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def load_policy(path: str | Path, dtype: str | torch.dtype = "float32", attn_implementation: str = "sdpa",
                gradient_checkpointing: bool = False, freeze_vision: bool = False, device: str | None = None):
    """A Qwen-VL (or text-only Qwen) policy from `path`, with the given dtype and attention implementation.

    freeze_vision: no gradients for the vision tower (common for grounding RL); the grouped forward then still runs
    it once per prompt, under no_grad."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    _check_local(path)
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation)
    if device is not None:
        model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if freeze_vision and hasattr(model, "model") and hasattr(model.model, "visual"):
        model.model.visual.requires_grad_(False)
    return model
