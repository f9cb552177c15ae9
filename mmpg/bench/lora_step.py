"""The step level's LoRA options (`mmpg.bench.step.setup`, case lora_r and ref), apart so that the program comparing
them (`mmpg.bench.lora`) and the step level import no circle. The adapters are the trainer's own
(`mmpg.models.lora.apply_lora`: the language model's q,k,v,o,gate,up,down; alpha 2r here), and with ref
"adapters_off" the step is given no reference model, so `GRPOStep` takes the policy with its adapters switched off,
as a LoRA run does."""

from __future__ import annotations


def apply_lora(model, r: int) -> bool:
    """r > 0: the trainer's LoRA (alpha 2r, no dropout, seed 0) injected into `model` in place; everything but the
    adapters frozen. r = 0: the model untouched. Returns whether adapters were added."""
    if r <= 0:
        return False
    from mmpg.config import LoraConfig
    from mmpg.models import lora

    lora.apply_lora(model, LoraConfig(r=r, alpha=2 * r, dropout=0.0), "bench-model", freeze_vision=True, seed=0)
    return True


def check_reference(ref: str, adapted: bool) -> None:
    """ref "adapters_off" needs adapters: without them the policy is no reference."""
    if ref == "adapters_off" and not adapted:
        raise ValueError("ref=adapters_off needs lora_r > 0 (without adapters the policy is no reference)")
