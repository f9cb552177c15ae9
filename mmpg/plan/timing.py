"""The time of one GRPO step by phase, per rank, from FLOPs and bytes, and the devices a plan is made for: GPU
presets (memory, dense bf16 peak, bandwidth) and this machine's CPU, probed (estimates: nothing here is measured
on a GPU).

    compute phases   seconds = FLOPs / (peak · mfu)       vision tower, rollout prefill, reference (and, with
                                                          μ > 1, old-policy) logprobs, update (3× forward; 4× with
                                                          gradient checkpointing, which reruns the forward) × μ
    decode           S - 1 steps, each max(bytes read / (bandwidth · bw_util), FLOPs / (peak · mfu)); bytes read
                     per step = the weights once + the K/V cache of the rank's B prompts (cascade: each prompt's
                     prefix once; copy / generate: G copies)
FLOPs are `mmpg.bench.flops`' (the vision tower's per-frame attention counted over the whole video: an upper
bound). `mfu` and `bw_util` are stated assumptions: the defaults (0.35, 0.6) are typical of bf16 training and
decoding with transformers-level kernels, not measured for mmpg. The naive layout rolls out with generate (G
prefills) and forwards G rows of [prompt | response]. Video sharing (data.queries_per_video > 1) is not credited:
each query is timed as if it had its video alone, an upper bound.
"""

from __future__ import annotations

import dataclasses
import time

from mmpg.bench import flops
from mmpg.errors import UserError
from mmpg.plan.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class Throughput:
    name: str
    tflops: float  # peak of the compute dtype
    bandwidth_tbs: float
    mfu: float = 0.35
    bw_util: float = 0.6


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float  # GiB the card has; the plan counts USABLE of it (`mmpg.plan.whole`)
    bf16_tflops: float  # dense bf16 tensor-core peak (no sparsity)
    bandwidth_tbs: float  # HBM/GDDR bandwidth, TB/s


GPUS = {  # vendors' data sheets (SXM parts where there are two)
    "a100-40": GPU("A100 40GB", 40, 312, 1.555), "a100-80": GPU("A100 80GB", 80, 312, 2.039),
    "h100": GPU("H100 80GB", 80, 989, 3.35), "h200": GPU("H200 141GB", 141, 989, 4.8),
    "a40": GPU("A40 48GB", 48, 149.7, 0.696), "l40s": GPU("L40S 48GB", 48, 362, 0.864),
    "4090": GPU("RTX 4090 24GB", 24, 165.2, 1.008),
}


def gpu(name: str) -> GPU:
    key = name.lower().replace(" ", "").replace("_", "-").replace("gb", "")
    key = {"a100": "a100-80", "rtx4090": "4090", "a10040": "a100-40", "a10080": "a100-80"}.get(key, key)
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)} or give --gpu-memory GB")
    return GPUS[key]


def cpu_memory() -> float:
    """This machine's memory (MemTotal, bytes): the device of `mmpg plan --device cpu`."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def cpu_throughput() -> tuple[float, float]:
    """This CPU's rates: (TFLOP/s of a float32 512x512 matmul, TB/s of a 64 MB copy), best of five tries."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    src = torch.empty(16 * 2 ** 20)
    dst = torch.empty_like(src)
    best_mm = best_cp = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best_mm = min(best_mm, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        best_cp = min(best_cp, time.perf_counter() - t0)
    return 2 * 512 ** 3 / best_mm / 1e12, 2 * src.numel() * 4 / best_cp / 1e12


def phase_flops(r: Recipe, mu: int = 1) -> dict:
    """FLOPs of one prompt's phases ("rollout_decode": all S - 1 decode steps together)."""
    d, P, S, G = r.geometry, r.P, r.S, r.G
    video = {"video_patches": r.patches, "frame_patches": 0}
    if r.patches and d.vision is not None:  # per-frame attention: a frame's patches (merge² per token, ~256 tokens)
        video["frame_patches"] = min(r.patches, 1024)
    vision = flops._vision_forward(d, 1, True, **video)
    lm_rollout = flops.rollout_flops(d, P, S, G, r.grouped)
    decode_total = lm_rollout - flops.rollout_flops(d, P, 1, G, r.grouped)
    fwd = flops.forward_flops(d, P, S, G, r.grouped, **video)
    lm_fwd = flops.forward_flops(d, P, S, G, r.grouped)
    upd = (4 if r.ckpt else 3) * lm_fwd + (fwd - lm_fwd) * (1 if r.freeze_vision else 3)
    out = {"vision": vision, "rollout_prefill": lm_rollout - decode_total, "rollout_decode": decode_total,
           "update": mu * upd}
    if r.reference != "none":
        out["reference"] = fwd
    if mu > 1:
        out["old_logprobs"] = fwd
    return out


def decode_step_bytes(r: Recipe) -> float:
    """Bytes one decode step reads on a rank: the weights and the K/V of its prompts at mid-response."""
    g = r.geometry
    kv_token = 2 * g.layers * g.kv_heads * g.d * r.b
    mid = r.S / 2
    tokens = r.P + r.G * mid if (r.grouped and r.decode == "cascade") else r.G * (r.P + mid)
    return g.lm_params() * r.b + r.prompts * tokens * kv_token


def step_seconds(r: Recipe, hw: Throughput, mu: int = 1) -> dict:
    """Seconds per phase on one rank for its B prompts (B = data.batch_size / devices: under sequence parallelism
    a rank rolls out its part of the whole prompts and holds 1/sp of each of its group's rows), and "total"."""
    f = phase_flops(r, mu)
    rate = hw.tflops * 1e12 * hw.mfu
    out = {k: r.prompts * v / rate for k, v in f.items() if k != "rollout_decode"}
    steps = max(r.S - 1, 0)
    per_step_flops = r.prompts * f["rollout_decode"] / max(steps, 1)
    per_step = max(decode_step_bytes(r) / (hw.bandwidth_tbs * 1e12 * hw.bw_util), per_step_flops / rate)
    out["rollout_decode"] = steps * per_step
    out["total"] = sum(out.values())
    return out
