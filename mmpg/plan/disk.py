"""`mmpg plan`'s disk lines: one checkpoint's size by part, with and without its optimizer state, and what a run's
checkpoints need on disk (checkpoint.keep_last, checkpoint.optimizer_state, how many saves), from the recipe's
parameter counts — the same sizes the trainer checks against the free disk before each save (`mmpg.runs.disk`,
where the table of what DeepSpeed and save_pretrained write lives)."""

from __future__ import annotations

from mmpg.plan.memory import Recipe
from mmpg.runs.disk import checkpoint_sizes, gb, run_disk, saves_in_run


def disk_plan(cfg, r: Recipe, device: str = "cuda") -> dict:
    """{"checkpoint": {"full_bytes", "weights_only_bytes", "parts"}, "optimizer_state", "keep_last", "saves",
    "kept", "steady_bytes", "peak_bytes"} (`mmpg.runs.disk.run_disk`)."""
    g = r.geometry
    sizes = checkpoint_sizes(g.params(), r.trainable(), r.b, r.zero, r.world, lora=bool(r.lora_r),
                             gpu=device == "cuda")
    c = cfg.checkpoint
    saves = saves_in_run(cfg.trainer.total_steps, c.every_n_steps)
    run = run_disk(sizes, c.keep_last, c.optimizer_state, saves)
    parts = {"weights": sizes.weights, "deepspeed module": sizes.module, "fp32 master": sizes.master,
             "AdamW m and v": sizes.moments, "processor and small files": sizes.processor + sizes.small}
    return {"checkpoint": {"full_bytes": sizes.full, "weights_only_bytes": sizes.weights_only, "parts": parts},
            "optimizer_state": c.optimizer_state, "keep_last": c.keep_last, "saves": saves, **run}


def render_disk(d: dict, zero: int, devices: int) -> list[str]:
    ck = d["checkpoint"]
    parts = ", ".join(f"{k} {gb(v)}" for k, v in ck["parts"].items() if v)
    keep = "all" if d["keep_last"] <= 0 else d["keep_last"]
    return [f"checkpoint: {gb(ck['full_bytes'])} with optimizer state ({parts}; ZeRO {zero}, {devices} ranks), "
            f"{gb(ck['weights_only_bytes'])} weights-only",
            f"disk for checkpoints (checkpoint.keep_last {keep}, optimizer_state {d['optimizer_state']}, "
            f"{d['saves']} saves): {gb(d['steady_bytes'])} for the {d['kept']} kept, {gb(d['peak_bytes'])} at most "
            "while a save is written beside them"]
