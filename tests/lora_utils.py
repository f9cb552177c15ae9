"""LoRA adapter checkpoints for tests, made directly with peft (the format `PeftModel.save_pretrained` writes and
training checkpoints hold): adapter_config.json (base_model_name_or_path = the base's absolute path) +
adapter_model.safetensors + the processor files. lora_B is random, so the adapter changes the outputs."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_regex(modules=TEXT_PROJECTIONS) -> str:
    """peft target_modules (a regex, matched in full): these projections of the language model only."""
    return r".*language_model.*\.(" + "|".join(modules) + ")"


def peft_policy(base: Path, modules=TEXT_PROJECTIONS, r: int = 4, seed: int = 0, std: float = 0.05):
    """(PeftModel on the float32 base, processor), lora_B drawn from N(0, std) (peft starts it at 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(Path(base).resolve()), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=target_regex(modules)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return peft_model, AutoProcessor.from_pretrained(base)


def adapter_checkpoint(base: Path, out: Path, **kwargs) -> Path:
    """Save a random adapter on `base` (see `peft_policy`) with the processor into `out`; returns `out`."""
    peft_model, processor = peft_policy(base, **kwargs)
    peft_model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
