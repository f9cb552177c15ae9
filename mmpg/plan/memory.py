"""The per-device memory of one GRPO step by part and phase, from a `Recipe`'s sizes alone (no model is built).

`predict(recipe)` gives the bytes by part at the peak, each phase's peak and which phase is largest: the persistent
part (model states, the reference copy, the inputs) plus the largest phase (rollout, reference logprobs, update;
self-check and decoding on the CPU). Notation: h hidden, L layers, Hq/Hkv heads of d, I MLP width, V vocabulary,
b bytes per value; N parameters (N_t trainable), W ranks ZeRO shards over, P prompt tokens, G responses of S
tokens, k groups per micro-batch, B prompts rolled out per rank.
  model states   as DeepSpeed 0.19 allocates them: weights b·N, gradients b·N_t, fp32 master 4·N_t (+ 8·N_t of
                 flat buffers under ZeRO-3), AdamW m and v 8·N_t, each / W from the stage that shards it
  activations    `per_token_layer` values a token and layer (h with checkpointing) on the update's row of
                 T = k (P + G S) tokens grouped, k G (P + S) naive; / sp under sequence parallelism
  LM head        chunks of LOGITS_CHUNK response positions (grouped), S + 1 positions of every row (naive)
  vision         one block alive when frozen, every block's saves when trained; the naive layout repeats the pixels
  rollout        the K/V cache (2 L Hkv d b a token: cascade P + G S a prompt, copy G (P + S)) and the prefill's
                 one-layer transient; not split by sp (each rank rolls out whole prompts)
Terms under `device="cpu"` were measured on the CPU only, so a GPU plan leaves them out. Each term in full, with its
source in DeepSpeed, transformers or a measurement: docs/plan.md, "The memory model".
"""

from __future__ import annotations

import dataclasses
import math

from mmpg.models.geometry import Geometry
from mmpg.plan.recipe import Recipe

LOGITS_CHUNK = 2048  # mmpg.grouping.logprobs.head_logprobs' chunk_size


def states(r: Recipe) -> dict:
    """Model states per rank (bytes): weights, gradients, master (what DeepSpeed allocates at set-up: the fp32
    master partition, ZeRO-3's flat gradient buffers), optimizer (AdamW's m and v, allocated at the first step),
    reference, cpu_offload (host memory)."""
    n, nt, w, b = r.geometry.params(), r.trainable(), r.world, r.b
    weights = b * n / (w if r.zero >= 3 else 1)
    grads = b * nt / (w if r.zero >= 2 else 1)
    shard = w if r.zero >= 1 else 1
    master = 4 * nt / shard if (r.mixed or r.zero in (1, 2)) else 0.0  # ZeRO-3 float32 shares the partition
    if r.zero >= 3:  # grad_partitions_flat_buffer and the fp32 partition's gradient buffer (stage3.py)
        master += 8 * nt / w
    opt = 8 * nt / shard
    host = 0.0
    if r.offload:
        host, opt, master = host + opt + master, 0.0, 0.0
        if r.zero >= 3:
            host, weights = host + weights, b * r.geometry.layer_params()  # one gathered layer at a time
    ref = b * n / (w if r.zero >= 3 else 1) if r.reference == "copy" else 0.0
    return {"weights": weights, "gradients": grads, "master": master, "optimizer": opt, "reference": ref,
            "cpu_offload": host}


def per_token_layer(g: Geometry) -> int:
    """a: the values autograd saves per token and decoder layer without checkpointing: 4h (two RMSNorms' inputs
    and outputs) + 3 Hq d (rotated q, attention output, o_proj input) + 2 Hkv d (rotated k, v) + 4I (gate, its
    SiLU, up, their product)."""
    return 4 * g.hidden + 3 * g.heads * g.d + 2 * g.kv_heads * g.d + 4 * g.intermediate


def layer_transient(g: Geometry, tokens: float, b: int) -> float:
    """A no-grad decoder layer's largest live set on `tokens` tokens: the residual stream and the normed input
    (2h) beside the larger of the MLP's (gate, up, their product: 3I) and attention's (q, attention output and its
    reshaped copy: 3 Hq d; k, v and their rotated copies: 4 Hkv d)."""
    return tokens * b * (2 * g.hidden + max(3 * g.intermediate, 3 * g.heads * g.d + 4 * g.kv_heads * g.d))


def mask_bytes(queries: float, keys: float) -> float:
    """The bool attention mask transformers builds for a prefill through sdpa, one byte per (query, key) pair
    (inferred from the measured CPU rollouts: their peak grows as P² at P 1k and 8k; the grouped forward builds
    none on the CPU)."""
    return queries * keys


def head_bytes(r: Recipe, rows: int) -> float:
    """The LM head's logits for the update / reference: chunked (grouped) or logits_to_keep (naive)."""
    V = r.geometry.vocab
    if r.full_logits:  # logits, their log-softmax and, in backward, its gradient: all in the compute dtype
        return r.update_tokens() / r.sp * V * 3 * r.b
    if r.grouped:
        return min(LOGITS_CHUNK, rows) * V * (r.b + 8)
    return rows * V * (r.b + 8)


def vision_bytes(r: Recipe, pixel_copies: int, tower_copies: int, train: bool) -> float:
    """Extra copies of the video's pixels (the naive layout repeats the prompt) and the tower's activations on
    `tower_copies` videos (one block alive when frozen, every block's saves when trained)."""
    v = r.geometry.vision
    if v is None or not r.video_tokens:
        return 0.0
    n = r.patches / r.sp
    # a frozen block's live set per patch, the larger of attention's (the residual, its normed copy, the fused qkv
    # output, the rotated q and k, the per-window q, k, v slices, their concatenated output and the projection: 12 hv)
    # and the MLP's (residual, normed input, output: 3 hv, and the activation, up and product: mats·Iv); a trained
    # block keeps about that many for backward
    per_block = tower_copies * n * r.b * max(12 * v.hidden, 3 * v.hidden + v.mlp_mats * v.intermediate)
    return pixel_copies * n * v.patch_dim * r.b + (v.depth * per_block if train else per_block)


def _peak(*moments: dict) -> dict:
    """The moment (parts -> bytes) with the largest sum."""
    return max(moments, key=lambda m: sum(m.values()))


def _pixel_copies(r: Recipe) -> float:
    """The naive layout's G copies of each micro-batch video's pixels (the prompt repeated per response)."""
    return 0.0 if r.grouped else vision_bytes(r, r.micro_groups * r.G, 0, False)


def _encode(r: Recipe, train: bool) -> float:
    """The vision tower's activations on the forward's videos: each prompt's once grouped, G times naive."""
    k = r.micro_groups
    return vision_bytes(r, 0, r.videos(k) if r.grouped else k * r.G, train)


# ---- CPU-only terms: measured on the CPU (`mmpg.plan.validate`, `mmpg train` runs), where the step runs float32
# through sdpa and the process's memory is the device's; on a GPU each either lives in host memory or has not been
# measured, so the GPU plan leaves it out (docs/plan.md, "What the CPU plan adds").

def frames_bytes(r: Recipe) -> float:
    """The decoded frames the batch keeps beside the processor's pixel values (`mmpg.data.video.DecodedVideo`:
    [T, C, H, W] float32, as many values as the pixel values), when the videos are decoded in the training process
    (data.num_workers 0). A DataLoader worker hands its batch over in shared memory, and the training process
    touches the pixel values (counted as `inputs`) but never the frames' pages: they are not in its memory
    (measured: the update's level +147 MB at P 8k with num_workers 0, +0 with 1)."""
    v = r.geometry.vision
    if r.device != "cpu" or not r.decode_here or v is None:
        return 0.0
    return r.videos(r.prompts) * r.patches * v.patch_dim * 4


def decode_bytes(r: Recipe) -> dict:
    """Decoding in the training process (data.num_workers 0), beside the frames and the pixel values it makes: the
    video processor's two float32 working copies (rescaled, then cut into patches; measured 4.1 x the pixel values
    in all at P 8k)."""
    return {"decode": 2 * frames_bytes(r)}


def dense_mask_bytes(r: Recipe, transient: bool = True) -> float:
    """The naive forward's attention mask when its rows carry padding (responses of unequal length, `ragged`):
    transformers builds a bool mask [k G, 1, W, W] (W = P + S) for the whole forward, and each sdpa call converts it
    to an additive one in the compute dtype (aten's sdpa, freed when the call returns: `transient`). Rows without
    padding (the bench's responses of exactly S tokens) build none: measured, the bench's naive cases at P 8k are
    within 8-12 % without it and 2.1x over with it; a run's naive case at P 1k, G 16 needs it (x1.40 -> x1.12).
    The grouped forward builds none on the CPU."""
    if r.device != "cpu" or r.grouped or not r.ragged:
        return 0.0
    rows, width = r.micro_groups * r.G, r.P + r.S
    return rows * width * width * (1 + (r.b if transient else 0))


def hooked_vision_bytes(r: Recipe) -> float:
    """Under gradient checkpointing transformers makes the vision tower's patch embedding output require grad
    (`enable_input_require_grads`), so a frozen tower runs with autograd: besides each checkpointed block's input
    (`update_bytes`) it keeps the patch embedding's output, its two window reorderings and the merger's input,
    4 patches x hv values per video of the forward. Measured on the tiny Qwen2.5-VL (vision depth 2, saved-tensor
    hooks on the frozen tower under checkpointing): 5.6 x hv values a patch, against the plan's depth + 4 = 6."""
    v = r.geometry.vision
    if r.device != "cpu" or not (r.ckpt and r.freeze_vision) or v is None:
        return 0.0
    copies = r.videos(r.micro_groups) if r.grouped else r.micro_groups * r.G
    return 4 * copies * r.patches / r.sp * v.hidden * r.b


def optimizer_step_bytes(r: Recipe) -> float:
    """torch AdamW's single-tensor step on the CPU makes two temporaries of each tensor it updates (the square root
    of v and its quotient): of the flat partition under ZeRO 1-3 (plus ZeRO-3's float32 copy of its gradient,
    `_prepare_fp32_grad_for_sub_group`), of the largest trained tensor at ZeRO-0. Measured on a warm step of a
    9.6M-trained-parameter model (36.8 MB): ZeRO-2 +74.6 MB (planned 73.6), ZeRO-3 +114.7 (110.4), ZeRO-0 +7 (4).
    A cold ZeRO-0 step held ~44 MB more than its new AdamW states, not explained."""
    if r.device != "cpu" or r.offload:
        return 0.0
    shard = r.world if r.zero >= 1 else 1
    if r.zero >= 1:
        return (3 if r.zero >= 3 else 2) * 4 * r.trainable() / shard
    g = r.geometry
    largest = r.lora_r * max(g.hidden, g.intermediate, g.heads * g.d) if r.lora_r else max(
        g.vocab * g.hidden, g.hidden * g.intermediate)
    return 2 * 4 * min(largest, r.trainable())


def self_check_bytes(r: Recipe, st: dict) -> dict:
    """The self-check on one micro-batch (`mmpg.grouping.selfcheck`, at the first step and when the batch grows):
    the repeated forward of its k G rows without grad (the naive layout's reference forward) beside the grouped
    one, or the grouped forward and backward with autograd recording, to the layers' inputs (no parameter
    gradient)."""
    naive = dataclasses.replace(r, grouped=False, decode="copy", queries=1)
    return _peak(reference_bytes(naive, st), update_bytes(r, dict(st, gradients=0.0)))


def update_bytes(r: Recipe, st: dict) -> dict:
    """The update phase at its peak: encoding the video, the start of backward (activations, logits, gradients),
    or the optimizer step (a cold step: AdamW's state allocated there, after the activations are freed)."""
    g = r.geometry
    T = r.update_tokens() / r.sp
    a = per_token_layer(g)
    saved = T * r.b * (g.layers * (g.hidden if r.ckpt else a) + 3 * g.hidden)  # + embeddings, final norm
    if r.grouped:  # the sdpa backend copies each group's prefix K/V once to expand GQA heads, kept for backward
        saved += r.videos(r.micro_groups) * r.P / r.sp * r.b * 2 * (g.heads - g.kv_heads) * g.d * (
            1 if r.ckpt else g.layers)
    # backward: a checkpointed layer's recomputed saves, and the running layer's intermediates' gradients
    backward = saved + T * r.b * (a if r.ckpt else 0) + layer_transient(g, T, r.b)
    rows = r.micro_groups * r.G * (r.S if r.grouped else r.S + 1)
    opt = {"optimizer": st["optimizer"]} if not r.cold else {}
    train_vision = not r.freeze_vision
    saved_vision = _encode(r, True) if train_vision else 0.0
    if r.ckpt and not train_vision and g.vision:  # checkpointed vision blocks keep their inputs even when frozen
        copies = r.videos(r.micro_groups) if r.grouped else r.micro_groups * r.G
        saved_vision = copies * r.patches / r.sp * g.vision.depth * g.vision.hidden * r.b
    saved_vision += hooked_vision_bytes(r)
    logits = head_bytes(r, rows)
    # the naive forward's repeated pixels (and its mask) live until it returns, before backward; a checkpointed
    # layer's recompute in backward builds its mask again
    mask = dense_mask_bytes(r)
    step = {"optimizer": st["optimizer"], "gradients": st["gradients"], "optimizer_step": optimizer_step_bytes(r)}
    return _peak(dict(opt, pixel_copies=_pixel_copies(r), vision=_encode(r, train_vision)),
                 dict(opt, pixel_copies=_pixel_copies(r), vision=saved_vision, activations=saved, logits=logits,
                      mask=mask),
                 dict(opt, vision=saved_vision, activations=backward, logits=logits, gradients=st["gradients"],
                      mask=mask if r.ckpt else 0.0),
                 {k: v for k, v in step.items() if v})


def reference_bytes(r: Recipe, st: dict) -> dict:
    """The reference (or old-policy) logprobs, no grad: encoding the video, or one layer's transient on the row
    (+ the naive forward's prefill mask) with its logits."""
    g = r.geometry
    T = r.update_tokens() / r.sp
    rows = r.micro_groups * r.G * (r.S if r.grouped else r.S + 1)
    opt = {"optimizer": st["optimizer"]} if not r.cold else {}
    mask = 0.0 if r.grouped else (dense_mask_bytes(r) or mask_bytes(r.P + r.S, r.P + r.S))
    lm = layer_transient(g, T, r.b) + 2 * T * r.b * g.hidden + mask
    return _peak(dict(opt, pixel_copies=_pixel_copies(r), vision=_encode(r, False)),
                 dict(opt, pixel_copies=_pixel_copies(r), activations=lm,
                      logits=min(rows, LOGITS_CHUNK if r.grouped else rows) * g.vocab * (r.b + 4)))


def kv_cache_bytes(r: Recipe) -> float:
    """The rollout's K/V cache of the rank's prompts after the last decode step: cascade P + G S tokens a prompt,
    copy / generate G (P + S)."""
    g = r.geometry
    shared = r.grouped and r.decode == "cascade"
    if shared and r.queries > 1:  # the video's part once for its Q queries, each tail once (mmpg.rollout.shares)
        tail = r.P - r.video_tokens
        tokens = r.videos(r.prompts) * r.video_tokens + r.prompts * (tail + r.G * r.S)
    else:
        tokens = r.prompts * (r.P + r.G * r.S if shared else r.G * (r.P + r.S))
    return tokens * 2 * g.layers * g.kv_heads * g.d * r.b


def rollout_bytes(r: Recipe, st: dict) -> dict:
    """The rollout at its peak: encoding the video, the prefill (one layer's transient on a chunk and its mask
    against the prompt; generate prefills G copies of the text), or the K/V cache at the last decode step."""
    g = r.geometry
    kv_token = 2 * g.layers * g.kv_heads * g.d * r.b
    chunk = min(r.P, r.prefill_chunk or r.P)
    prefill = layer_transient(g, chunk if r.grouped else r.G * r.P, r.b) + mask_bytes(chunk, r.P)
    whole = dataclasses.replace(r, sp=1)  # each rank of a sequence-parallel group rolls out whole prompts
    opt = {"optimizer": st["optimizer"]} if not r.cold else {}
    prompt_kv = r.prompts * r.P * kv_token * (1 if r.grouped else r.G)
    return _peak(dict(opt, vision=vision_bytes(whole, 0, r.videos(r.prompts), False)),
                 dict(opt, kv_cache=prompt_kv, prefill=prefill),
                 dict(opt, kv_cache=kv_cache_bytes(r)))


def predict(r: Recipe, rollout: bool = True) -> dict:
    """{"parts": bytes by part at the peak, "phases": {phase: bytes at its peak}, "peak_bytes", "peak_phase"}.
    rollout=False: a step without sampling (a supervised step)."""
    st = states(r)
    pixels = r.videos(r.prompts) * r.patches * (r.geometry.vision.patch_dim if r.geometry.vision else 0) * r.b / r.sp
    persistent = {"weights": st["weights"], "master": st["master"], "reference": st["reference"], "inputs": pixels,
                  "frames": frames_bytes(r), "runtime": r.runtime if r.device == "cpu" else 0.0}
    phases = {"rollout": rollout_bytes(r, st), "reference_logprobs": reference_bytes(r, st),
              "update": update_bytes(r, st)}
    if r.self_check and r.grouped and r.device == "cpu":
        phases["self_check"] = self_check_bytes(r, st)
    if frames_bytes(r):
        phases["decode"] = decode_bytes(r)
    if r.reference == "none":
        phases.pop("reference_logprobs")
    if not rollout:
        phases.pop("rollout")
    totals = {k: sum(persistent.values()) + sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=totals.get)
    parts = dict(persistent, **phases[peak_phase])
    return {"parts": {k: int(math.ceil(v)) for k, v in parts.items()}, "phases": {k: int(v) for k, v in totals.items()},
            "peak_bytes": int(max(totals.values())), "peak_phase": peak_phase, "cpu_offload": int(st["cpu_offload"])}
