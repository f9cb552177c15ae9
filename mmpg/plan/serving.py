"""The memory of the vLLM servers a `rollout.engine=vllm` run starts, per GPU, beside the trainer's, in both layouts:
colocated (one server on each training GPU, sharing it: the trainer's peak plus the server's share must fit) and
separate (a pool of servers on GPUs of their own). Each server serves `ranks_per_server` training ranks' rollout
batches at once (the pool: rank r uses server r mod N).

A server's memory by part, in the server's dtype (`model.dtype`, 2 bytes a value on GPUs):
- weights: the whole model, the vision tower included (vLLM loads every tensor), over its tensor-parallel GPUs;
- kv_cache: every rollout sequence of its ranks at once, prefix caching on: a prompt's K/V once for its G samples
  (vLLM shares the prompt's blocks between them), P + G S tokens a prompt, in blocks of KV_BLOCK tokens;
- encoder_cache: the merged vision embeddings of the batch's videos (the encoder cache keeps them for prefill);
- activations: vLLM's profile run at max_num_batched_tokens (one decoder layer's live set on that many tokens) plus
  the sampler's logits (every sequence x the vocabulary in float32);
- runtime: the CUDA context, NCCL and graphs' share that vLLM's gpu_memory_utilization does not cover
  (RUNTIME_GPU, outside the fraction).
`gpu_memory_utilization` is vLLM's fraction of the whole GPU it may use for weights, activations and K/V: the
weights, activations, encoder cache and K/V above, over the GPU's memory, rounded up to 0.05 (at least 0.1).
"""

from __future__ import annotations

import math

from mmpg.plan.memory import layer_transient
from mmpg.plan.recipe import Recipe

KV_BLOCK = 16  # vLLM's default block size (tokens)
MAX_BATCHED_TOKENS = 8192  # vLLM's default max_num_batched_tokens on GPUs
RUNTIME_GPU = 1.5 * 2 ** 30  # CUDA context, cuBLAS workspaces, NCCL buffers: outside gpu_memory_utilization


def server_parts(r: Recipe, ranks_per_server: int, tp: int = 1) -> dict:
    """Bytes per GPU of one server (over `tp` tensor-parallel GPUs) serving `ranks_per_server` ranks' batches."""
    g = r.geometry
    prompts = r.prompts * ranks_per_server
    per_prompt = math.ceil(r.P / KV_BLOCK) * KV_BLOCK + r.G * math.ceil(r.S / KV_BLOCK) * KV_BLOCK
    kv_token = 2 * g.layers * g.kv_heads * g.d * r.b
    videos = r.videos(r.prompts) * ranks_per_server
    return {"weights": g.params() * r.b / tp,
            "kv_cache": prompts * per_prompt * kv_token / tp,
            "encoder_cache": videos * r.video_tokens * g.hidden * r.b / tp,
            "activations": (layer_transient(g, min(MAX_BATCHED_TOKENS, prompts * r.P), r.b) / tp
                            + prompts * r.G * g.vocab * 4)}


def utilization(parts: dict, gpu_memory: float) -> float:
    """vLLM's gpu_memory_utilization for these parts on a GPU of `gpu_memory` bytes: rounded up to 0.05, >= 0.1."""
    need = sum(parts.values()) / gpu_memory
    return max(0.1, math.ceil(need * 20 - 1e-9) / 20)


def server_plan(r: Recipe, trainer_peak: float, gpu_memory: float, budget: float, train_ranks: int,
                servers: int | None = None, tp: int = 1) -> dict:
    """Both layouts for `train_ranks` training GPUs. colocated: one server per training GPU, one rank each;
    separate: `servers` servers (default: one per two training ranks) of `tp` GPUs, ranks spread over them."""
    colocated = server_parts(r, 1)
    co_util = utilization(colocated, gpu_memory)
    co_total = trainer_peak + co_util * gpu_memory + RUNTIME_GPU
    servers = servers or max(1, train_ranks // 2)
    per_server = math.ceil(train_ranks / servers)
    separate = server_parts(r, per_server, tp)
    sep_util = utilization(separate, gpu_memory)
    return {"colocated": {"servers": train_ranks, "ranks_per_server": 1, "parts": _ints(colocated),
                          "gpu_memory_utilization": co_util, "gpu_bytes": int(co_total),
                          "fits": co_total <= budget},
            "separate": {"servers": servers, "tp": tp, "gpus": servers * tp, "ranks_per_server": per_server,
                         "parts": _ints(separate), "gpu_memory_utilization": sep_util,
                         "gpu_bytes": int(sep_util * gpu_memory + RUNTIME_GPU),
                         "fits": sep_util * gpu_memory + RUNTIME_GPU <= gpu_memory}}


def render(s: dict, gb) -> list[str]:
    """The plan's lines for the servers (`gb`: bytes -> text)."""
    co, sep = s["colocated"], s["separate"]
    lines = ["vLLM servers (rollout.engine=vllm), per GPU:",
             f"  colocated: {co['servers']} servers, one on each training GPU: gpu_memory_utilization "
             f"{co['gpu_memory_utilization']:.2f} (VLLM_MEM), trainer + server {gb(co['gpu_bytes'])}: "
             f"{'FITS' if co['fits'] else 'DOES NOT FIT'}",
             f"  separate: {sep['servers']} server(s) of {sep['tp']} GPU(s), {sep['ranks_per_server']} rank(s) each: "
             f"gpu_memory_utilization {sep['gpu_memory_utilization']:.2f}, {gb(sep['gpu_bytes'])} a GPU: "
             f"{'FITS' if sep['fits'] else 'DOES NOT FIT'}",
             "  part                 colocated    separate"]
    lines += [f"  {k:<20} {gb(co['parts'][k]):>10}   {gb(sep['parts'][k]):>10}" for k in co["parts"]]
    return lines


def _ints(parts: dict) -> dict:
    return {k: int(math.ceil(v)) for k, v in parts.items()}
