"""The time of one GRPO step by phase, per rank, from FLOPs and bytes (estimates: nothing here is measured).

    compute phases   seconds = FLOPs / (peak · mfu)       vision tower, rollout prefill, reference (and, with
                                                          μ > 1, old-policy) logprobs, update (3× forward; 4× with
                                                          gradient checkpointing, which reruns the forward) × μ
    decode           S - 1 steps, each max(bytes read / (bandwidth · bw_util), FLOPs / (peak · mfu)); bytes read
                     per step = the weights once + the K/V cache of the rank's B prompts (cascade: each prompt's
                     prefix once; copy / generate: G copies)
FLOPs are `mmpg.bench.flops`' (causal attention, LM head on response positions, the vision tower's per-frame
attention counted over the whole video — an upper bound). `mfu` (model FLOPs utilisation) and `bw_util` are the
stated assumptions; the defaults (0.35, 0.6) are typical of bf16 training and decoding with transformers-level
kernels, not measured for mmpg on any GPU. The naive layout rolls out with generate (G prefills of the prompt) and
forwards G rows of [prompt | response]. Not modelled: video sharing (data.queries_per_video > 1) times each query as if
it had its video alone, an upper bound on the rollout, reference and update phases.
"""

from __future__ import annotations

import dataclasses

from mmpg.bench import flops
from mmpg.plan.memory import Recipe


@dataclasses.dataclass(frozen=True)
class Throughput:
    name: str
    tflops: float  # peak of the compute dtype
    bandwidth_tbs: float
    mfu: float = 0.35
    bw_util: float = 0.6


def phase_flops(r: Recipe, mu: int = 1) -> dict:
    """FLOPs of one prompt's phases (decode per step separately: `decode_step_flops`)."""
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
