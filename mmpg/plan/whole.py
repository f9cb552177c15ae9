"""The whole plan of a config on N devices as one dict (what `mmpg plan --json` prints and `mmpg plan --run` sets
beside a run's measured peak): the memory by part and phase, the other layout's peak and time beside it, the step
time by phase at the stated rates, the disk a run's checkpoints need, and, when it does not fit, the cheapest
changes that make it fit. A device is taken to hold USABLE of its memory for tensors (the rest: CUDA context, NCCL
buffers, allocator fragmentation).

What makes a recipe fit (`candidates`): each single change a user can make from the config, named by its config
key, cheapest first by what it costs a run: a smaller micro-batch (no change to the maths), gradient checkpointing
(~1/3 more update compute), ZeRO-3 (more communication), CPU offload (a much slower optimizer step), LoRA (a
different training method), sequence parallelism (fewer data-parallel groups), a smaller frame or pixel budget, a
smaller group (both change what is trained on).

The disk lines: one checkpoint's size by part, with and without its optimizer state, and what a run's checkpoints
need (checkpoint.keep_last, checkpoint.optimizer_state, how many saves), the same sizes the trainer checks against
the free disk before each save (`mmpg.runs.disk`).

An SFT step (`sft_plan`) is planned as the update phase with one response per prompt (the target: SFT_TARGET_TOKENS,
or a run's sft/target_tokens), no rollout and no reference; its time is that update alone.
"""

from __future__ import annotations

import copy
import dataclasses

from mmpg.plan.memory import predict
from mmpg.plan.recipe import Recipe, recipe_from_config
from mmpg.plan.timing import phase_flops, step_seconds
from mmpg.runs.disk import checkpoint_sizes, gb, run_disk, saves_in_run

USABLE = 0.9
SFT_TARGET_TOKENS = 40  # the default target with Qwen2.5's tokenizer: 34-37 tokens (two-decimal spans), + margin


def plan(cfg, gpus: int, device: str, memory: float, hw, video=None, prompt=None) -> dict:
    """The whole plan as a dict (what --json prints)."""
    r = recipe_from_config(cfg, gpus, device, video, prompt)
    mem = predict(r)
    budget = memory * (USABLE if device == "cuda" else 1.0)
    flipped, mu = flip(r), cfg.algorithm.num_iterations
    naive = predict(flipped)
    out = {"model": r.geometry.name, "params": r.geometry.params(), "trainable_params": r.trainable(),
           "device": device, "devices": gpus, "memory_bytes": int(memory), "budget_bytes": int(budget),
           "P": r.P, "video_tokens": r.video_tokens, "S": r.S, "G": r.G, "zero": r.zero, "offload": r.offload,
           "sp": r.sp, "layout": "grouped" if r.grouped else "naive", "peak_bytes": mem["peak_bytes"],
           "peak_phase": mem["peak_phase"], "parts": mem["parts"], "phases": mem["phases"],
           "cpu_offload_bytes": mem["cpu_offload"], "fits": mem["peak_bytes"] <= budget,
           "other_layout_peak_bytes": naive["peak_bytes"],
           "step_seconds": step_seconds(r, hw, mu),
           "other_layout_step_seconds": step_seconds(flipped, hw, mu)["total"],
           "assumed": {"mfu": hw.mfu, "bw_util": hw.bw_util, "tflops": hw.tflops, "bandwidth_tbs": hw.bandwidth_tbs,
                       "usable_fraction": USABLE if device == "cuda" else 1.0},
           "what_fits": [] if mem["peak_bytes"] <= budget else what_fits(r, budget)}
    out["disk"] = disk_plan(cfg, r, device)  # a checkpoint's size and what the run's checkpoints need
    if cfg.rollout.engine == "vllm":
        if device == "cuda":  # the servers' memory beside the trainer's, both layouts (`mmpg.plan.serving`)
            from mmpg.plan.serving import server_plan

            out["servers"] = server_plan(r, mem["peak_bytes"], memory, budget, gpus)
        else:
            out["note"] = ("rollout.engine=vllm: on a CPU the server's K/V lives in its own memory "
                           "(VLLM_CPU_KVCACHE_SPACE), not counted here")
    return out


def flip(r: Recipe) -> Recipe:
    """The same recipe in the other layout (grouped <-> naive, with its rollout)."""
    return dataclasses.replace(r, grouped=not r.grouped, decode="copy" if r.grouped else "cascade")


def sft_config(cfg, metrics: list[dict]):
    """The config as the plan sees an SFT step: one response per prompt (the target), no reference."""
    c = copy.deepcopy(cfg)
    tokens = [m["sft/target_tokens"] for m in metrics if isinstance(m.get("sft/target_tokens"), (int, float))]
    c.rollout.n, c.algorithm.beta, c.algorithm.self_check = 1, 0.0, "off"
    c.rollout.max_new_tokens = max(1, round(max(tokens) / cfg.data.batch_size)) if tokens else SFT_TARGET_TOKENS
    return c


def sft_plan(cfg, gpus: int, device: str, memory: float, hw, video=None, prompt=None, metrics=()) -> dict:
    """`plan`'s dict for an SFT step of `cfg` (per rank the model states, then for each micro-batch of
    trainer.micro_batch_size prompts the forward and backward of [prompt | target] rows), with "job": "sft";
    `metrics`: a run's metrics lines (their sft/target_tokens size S)."""
    c = sft_config(cfg, list(metrics))
    out = plan(c, gpus, device, memory, hw, video, prompt)  # geometry, states, disk: as a GRPO step's
    r = recipe_from_config(c, gpus, device, video, prompt)
    naive = flip(r)
    mem, other = predict(r, rollout=False), predict(naive, rollout=False)
    rate = hw.tflops * 1e12 * hw.mfu
    seconds = r.prompts * phase_flops(r, 1)["update"] / rate
    fits = mem["peak_bytes"] <= out["budget_bytes"]
    peaks = [] if fits else [(change, predict(new, rollout=False)["peak_bytes"]) for change, new in candidates(r)]
    rows = [{"change": change, "peak_bytes": peak, "fits": peak <= out["budget_bytes"]} for change, peak in peaks]
    out.update(job="sft", peak_bytes=mem["peak_bytes"], peak_phase=mem["peak_phase"], parts=mem["parts"],
               phases=mem["phases"], fits=fits, other_layout_peak_bytes=other["peak_bytes"],
               step_seconds={"update": seconds, "total": seconds},
               other_layout_step_seconds=r.prompts * phase_flops(naive, 1)["update"] / rate, what_fits=rows,
               cpu_offload_bytes=mem["cpu_offload"])
    out.pop("note", None)  # a vLLM rollout note: an SFT step samples nothing
    return out


def candidates(r: Recipe) -> list[tuple[str, Recipe]]:
    """(config change, the recipe with it) for every single change that applies, cheapest first."""
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
