"""The step level's LoRA options (`mmpg.bench.step.setup`, case lora_r and ref), apart so that the program comparing
them (`mmpg.bench.lora`) and the step level import no circle: LoRA injected into the bench model with peft, and the
KL reference as the policy with its adapters switched off instead of a frozen copy."""

from __future__ import annotations

LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def apply_lora(model, r: int):
    """r > 0: peft LoRA (alpha 2r, no dropout) on every projection of the language model, injected into `model`
    (which stays the module the trainer sees; everything but the adapters is frozen); returns the PeftModel.
    r = 0: None, the model untouched."""
    if r <= 0:
        return None
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LORA_TARGETS))


def adapters_off_reference(grpo, lora) -> None:
    """Case ref="adapters_off": the KL reference logprobs come from the policy under `disable_adapter()`."""
    if lora is None:
        raise ValueError("ref=adapters_off needs lora_r > 0 (without adapters the policy is no reference)")
    plain = grpo._logprobs

    def logprobs(model, mb, chunk):
        if model is not lora:
            return plain(model, mb, chunk)
        with lora.disable_adapter():
            return plain(grpo.policy, mb, chunk)

    grpo._logprobs, grpo.ref = logprobs, lora
