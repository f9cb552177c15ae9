"""What makes a recipe fit: each single change a user can make from the config, with its new peak, cheapest first.

The order is what each change costs a run: a smaller micro-batch (more, smaller update calls: no change to the
maths), gradient checkpointing (~1/3 more update compute), ZeRO-3 (more communication), CPU offload (much slower
optimizer step), LoRA (a different training method), sequence parallelism (fewer data-parallel groups per GPU),
a smaller frame or pixel budget, a smaller group (both change what is trained on). Each row is one change on its
own; the config key to set is named.
"""

from __future__ import annotations

import dataclasses

from mmpg.plan.memory import Recipe, predict


def candidates(r: Recipe) -> list[tuple[str, Recipe]]:
    out = []
    if r.micro_groups > 1:
        out.append((f"trainer.micro_batch_size={r.G}", dataclasses.replace(r, micro_groups=1)))
    if not r.ckpt:
        out.append(("model.gradient_checkpointing=true", dataclasses.replace(r, ckpt=True)))
    if r.zero < 3 and r.world > 1:
        out.append(("deepspeed.zero_stage=3 (deepspeed.config=configs/deepspeed/zero3.json)",
                    dataclasses.replace(r, zero=3)))
    if not r.offload:
        out.append(("deepspeed.offload=true (ZeRO-3, optimizer and weights in CPU memory)",
                    dataclasses.replace(r, zero=3, offload=True)))
    if not r.lora_r:
        ref = "adapters_off" if r.reference != "none" else "none"
        out.append(("model.lora.r=64", dataclasses.replace(r, lora_r=64, reference=ref)))
    for sp in (2, 4, 8):
        if sp > r.sp and r.world % sp == 0 and r.geometry.heads % sp == 0:
            out.append((f"parallel.sequence_parallel_size={sp}", dataclasses.replace(r, sp=sp)))
            break
    if r.video_tokens >= 512:
        half = r.video_tokens // 2
        out.append((f"half the frame/pixel budget (data.total_pixels: {half} video tokens)",
                    dataclasses.replace(r, video_tokens=half, P=r.P - r.video_tokens + half)))
    if r.G >= 4:
        out.append((f"rollout.n={r.G // 2} trainer.micro_batch_size={r.micro_groups * r.G // 2}",
                    dataclasses.replace(r, G=r.G // 2)))
    return out


def what_fits(r: Recipe, budget: float) -> list[dict]:
    """[{"change", "peak_bytes", "fits"}] for every candidate, in the order above."""
    rows = []
    for change, new in candidates(r):
        peak = predict(new)["peak_bytes"]
        rows.append({"change": change, "peak_bytes": peak, "fits": peak <= budget})
    return rows
