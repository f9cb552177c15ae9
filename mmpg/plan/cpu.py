"""`mmpg plan --device cpu` for the bench's step cases: the recipe a case runs, in float32 on this machine's CPU.

A case (`mmpg.plan.validate.case`) is the bench's step level: one prompt, G responses of exactly S tokens, one
micro-batch, the KL term on against a frozen copy (or, with LoRA, the policy with its adapters off), float32, the
vision tower frozen, DeepSpeed at the case's ZeRO stage in one process (so ZeRO shards over one rank: its stages
differ here only by what they keep besides the weights). Of the CPU plan's own terms (`mmpg.plan.memory`) the case
carries those its measured step has: not the training run's `runtime` (the bench's baseline is taken after a warm
step), no decoded frames (its measured peaks hold none beside the pixel values) and no padded naive rows (every
response is S tokens, so no dense mask).
"""

from __future__ import annotations

from mmpg.plan.memory import Recipe, predict


def case_recipe(case: dict) -> Recipe:
    from mmpg.bench.batch import prompt_shape
    from mmpg.bench.model import model_config
    from mmpg.models.geometry import from_config_dict

    config, _ = model_config(case)
    geometry = from_config_dict(config.to_dict(), case.get("name", case["family"]))
    shape = prompt_shape(case["P"], config, case.get("video"))
    grouped = case["variant"] != "naive"
    return Recipe(geometry, P=shape["P"], S=case["S"], G=case["G"], video_tokens=shape.get("video_tokens", 0), b=4,
                  mixed=False, zero=case.get("zero", 0), lora_r=case.get("lora_r", 0),
                  freeze_vision=case.get("freeze_vision", True),
                  reference=("adapters_off" if case.get("ref") == "adapters_off" else "copy")
                  if case.get("beta", 0.04) > 0 else "none",
                  ckpt=bool(case.get("grad_ckpt")), grouped=grouped, decode="cascade" if grouped else "copy",
                  cold=True, device="cpu", self_check=case.get("self_check", "on") != "off")


def predict_case(case: dict) -> int:
    """Predicted CPU peak (bytes) of the case's build + one cold step, as `mmpg.plan.measure` measures it."""
    return predict(case_recipe(case))["peak_bytes"]
