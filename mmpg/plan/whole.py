"""The whole plan of a config on N devices as one dict (what `mmpg plan --json` prints and `mmpg plan --run` sets
beside a run's measured peak): the memory by part and phase, the other layout's peak and time beside it, the step
time by phase at the stated rates, and, when it does not fit, the cheapest changes that make it fit. A device is taken
to hold USABLE of its memory for tensors (the rest: CUDA context, NCCL buffers, allocator fragmentation)."""

from __future__ import annotations

USABLE = 0.9


def plan(cfg, gpus: int, device: str, memory: float, hw, video=None, prompt=None) -> dict:
    """The whole plan as a dict (what --json prints)."""
    from mmpg.plan.fit import what_fits
    from mmpg.plan.memory import predict
    from mmpg.plan.recipe import recipe_from_config
    from mmpg.plan.timing import step_seconds

    r = recipe_from_config(cfg, gpus, device, video, prompt)
    mem = predict(r)
    budget = memory * (USABLE if device == "cuda" else 1.0)
    flipped, mu = _flip(r), cfg.algorithm.num_iterations
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
    from mmpg.plan.disk import disk_plan

    out["disk"] = disk_plan(cfg, r, device)  # a checkpoint's size and what the run's checkpoints need
    if cfg.rollout.engine == "vllm":
        out["note"] = ("rollout.engine=vllm: the rollout's K/V lives in the vLLM server's own memory "
                       "(its gpu_memory_utilization), not counted here")
    return out


def _flip(r):
    import dataclasses

    return dataclasses.replace(r, grouped=not r.grouped, decode="copy" if r.grouped else "cascade")
