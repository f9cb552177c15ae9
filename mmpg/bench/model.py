"""Model-level variants: one training step (logprobs of G responses, a loss, backward) on a random-weight model.

    repeated  `mmpg.grouping.repeated_logprobs`: the prompt (and its video) repeated G times, the model's own forward
    upstream  the PyPI package `prefix_grouper` wired through transformers' registry, as its README does: its
              `register_attention()` plus `attn_implementation="prefix_grouper_attention"`, the packed row
              [prompt | r_1 | ... | r_G] with positions 0..P-1, P..P+S-1 per response, the `PrefixGrouper` passed as a
              forward kwarg and the inner attention function our bottom-right-causal SDPA (`attention.upstream_sdpa`,
              registered under `mmpg_bench_upstream_sdpa`). Text-only families only: for Qwen-VL the package needs
              its copied modeling file (vision tower once, mRoPE positions), which we do not copy.
    mmpg      `mmpg.grouping.grouped_logprobs` (backend from the case, default: the model's).

The model is the family's real transformers class built from `mmpg.models.tiny.tiny_config` with the case's sizes
(any size: a Qwen2.5-VL-3B shape on a GPU too), random weights, `vocab` overridable. VL prompts hold one synthetic
video given directly as patches (`pixel_values_videos`, `video_grid_thw`), sized so the prompt has ~P tokens. All
variants take their logits at response-predicting positions only (`head_logprobs`, chunked) except `repeated`,
which uses the model's forward with `logits_to_keep = S + 1`.
"""

from __future__ import annotations

import functools
import math

import torch

VARIANTS = ("repeated", "upstream", "mmpg")
TEXT_IDS = 600  # random text tokens are drawn below this id (under the tokenizer's special tokens)
UPSTREAM_INNER = "mmpg_bench_upstream_sdpa"


@functools.lru_cache(maxsize=4)
def _tokenizer(vocab_size: int):
    from mmpg.models.tokenizer import build_tokenizer

    return build_tokenizer(vocab_size, 0)


def model_config(case: dict):
    """(transformers config, tokenizer) for the case's family and sizes (`spec`: TinySpec fields; `vocab` and
    `vision_intermediate` override the tiny defaults, e.g. for a Qwen2.5-VL-3B shape)."""
    from mmpg.models.tiny import TinySpec, tiny_config

    spec = TinySpec(**case["spec"])
    tokenizer = _tokenizer(spec.vocab_size)
    config = tiny_config(case["family"], spec, tokenizer)
    if case.get("vocab"):
        config.get_text_config().vocab_size = case["vocab"]
    if case.get("vision_intermediate") and hasattr(config, "vision_config"):
        config.vision_config.intermediate_size = case["vision_intermediate"]
    return config, tokenizer


def build_model(case: dict, device: torch.device):
    """(model, ids): the case's model in the case's dtype (default float32), in train mode; ids holds the
    video/vision_start/vision_end token ids (None for text-only) and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from mmpg.models.tiny import VL_FAMILIES

    config, tokenizer = model_config(case)
    config._attn_implementation = "sdpa"
    auto = AutoModelForImageTextToText if case["family"] in VL_FAMILIES else AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = auto.from_config(config, dtype=getattr(torch, case.get("dtype", "float32")))
    if case.get("grad_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = {name: getattr(config, f"{name}_token_id", None) for name in ("video", "vision_start", "vision_end")}
    ids["tokenizer"] = tokenizer
    return model.train(), ids


def prompt_shape(P: int, config, video=None) -> dict:
    """The prompt actually built for a requested P: {"P"} for text-only; for VL also the video grid (t, h, w),
    its LM tokens, patches and patches per frame (what the vision tower's attention spans). `video` (frames, height,
    width) in pixels fixes the video instead of sizing it from P; P then only adds text after it."""
    vc = getattr(config, "vision_config", None)
    if vc is None:
        return {"P": P}
    t, h, w = video_grid(P) if video is None else pixel_grid(video, vc)
    n_tok = t * h * w // vc.spatial_merge_size ** 2
    return {"P": n_tok + 2 + max(P - n_tok - 2, 9), "grid": (t, h, w), "video_tokens": n_tok,
            "video_patches": t * h * w, "frame_patches": h * w}


def video_grid(P: int) -> tuple[int, int, int]:
    """(t, h, w) patch grid of a video giving about P - 16 LM tokens (merge 2: h·w/4 tokens per temporal patch)."""
    n = max(P - 16, 1)
    m = max(1, min(8, int(math.isqrt(n))))  # m² tokens per temporal patch, h = w = 2m patches
    return max(1, round(n / (m * m))), 2 * m, 2 * m


def pixel_grid(video, vision_config) -> tuple[int, int, int]:
    """(frames, height, width) in pixels -> the (t, h, w) patch grid; the sizes must tile exactly (no resize)."""
    frames, height, width = (int(x) for x in video)
    tps, patch = vision_config.temporal_patch_size, vision_config.patch_size
    side = patch * vision_config.spatial_merge_size
    if frames % tps or height % side or width % side or min(frames, height, width) < 1:
        raise ValueError(f"video {frames}x{height}x{width}: frames must be a multiple of {tps} and height, width "
                         f"multiples of {side} (patch {patch} x merge {vision_config.spatial_merge_size})")
    return frames // tps, height // patch, width // patch


def make_inputs(model, case: dict, ids: dict, device, seed: int = 1) -> tuple[dict, torch.Tensor, torch.Tensor,
                                                                               dict]:
    """prompt_inputs for one prompt, completion ids/mask [G, S], and `prompt_shape` (the actual P). `seed` draws
    the prompt's text, patches and completions (another seed: another prompt of the same shape)."""
    S, G = case["S"], case["G"]
    gen = torch.Generator().manual_seed(seed)
    shape = prompt_shape(case["P"], model.config, case.get("video"))
    text = torch.randint(0, TEXT_IDS, (shape["P"],), generator=gen)
    if ids["video"] is None:
        prompt = {"input_ids": text[None]}
    else:
        vc = model.config.vision_config
        (t, h, w), n_tok = shape["grid"], shape["video_tokens"]
        input_ids = torch.cat([text[:8], torch.tensor([ids["vision_start"]]), torch.full((n_tok,), ids["video"]),
                               torch.tensor([ids["vision_end"]]), text[8: shape["P"] - n_tok - 2]])[None]
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        pixels = torch.randn(t * h * w, dim, generator=gen)
        prompt = {"input_ids": input_ids, "pixel_values_videos": pixels.to(model.dtype),
                  "video_grid_thw": torch.tensor([[t, h, w]]),
                  "mm_token_type_ids": (input_ids == ids["video"]).to(torch.int32) * 2}
    prompt["attention_mask"] = torch.ones_like(prompt["input_ids"])
    prompt = {k: v.to(device) for k, v in prompt.items()}
    assert prompt["input_ids"].shape[1] == shape["P"], (prompt["input_ids"].shape, shape)
    completion_ids = torch.randint(0, TEXT_IDS, (G, S), generator=gen).to(device)
    info = {k: v for k, v in shape.items() if k != "grid"}
    return prompt, completion_ids, torch.ones_like(completion_ids), info


def _upstream_logprobs(model, prompt, completion_ids):
    """The upstream package's grouped forward: [G, S] float32 logprobs (text-only models)."""
    from prefix_grouper import PrefixGrouper

    from mmpg.grouping import head_logprobs

    P, (G, S) = prompt["input_ids"].shape[1], completion_ids.shape
    device = completion_ids.device
    grouper = PrefixGrouper([[P] + [S] * G], device=device)
    ids = torch.cat([prompt["input_ids"][0], completion_ids.reshape(-1)])[None]  # [1, P + G·S]
    pos = torch.cat([torch.arange(P, device=device), (P + torch.arange(S, device=device)).repeat(G)])[None]
    marker = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)  # a 4-D mask passes mask creation untouched
    hidden = model.model(input_ids=ids, position_ids=pos, attention_mask=marker, use_cache=False,
                         prefix_grouper=grouper, prefix_grouper_attn_func=UPSTREAM_INNER).last_hidden_state
    # suffix outputs with the last prefix position in front: [G, S + 1, H]; position t predicts token t
    _, _, suffix, _ = grouper.split_output(hidden, include_prefix_last=1)
    flat = head_logprobs(model.get_output_embeddings(), suffix[:, :S].reshape(G * S, -1), completion_ids.reshape(-1))
    return flat.view(G, S)


def _wire_upstream(model) -> None:
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    from mmpg.bench.attention import upstream_sdpa

    def inner(module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
        return upstream_sdpa(query, key, value, attention_mask, scaling=scaling), None

    register_attention()
    AttentionInterface.register(UPSTREAM_INNER, inner)
    model.set_attn_implementation("prefix_grouper_attention")


def setup(case: dict, device: torch.device):
    """(prepare, step, info) for one variant: model and inputs are built here (outside the memory window; prepare
    is None), `step()` is one training step."""
    from mmpg.grouping import grouped_logprobs, repeated_logprobs

    variant = case["variant"]
    if variant not in VARIANTS:
        raise ValueError(f"unknown model variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    model, ids = build_model(case, device)
    if variant == "upstream" and ids["video"] is not None:
        raise NotImplementedError("upstream prefix_grouper needs its copied modeling file for VL models")
    prompt, completion_ids, completion_mask, info = make_inputs(model, case, ids, device)
    G = completion_ids.shape[0]
    if variant == "upstream":
        _wire_upstream(model)

    def logprobs():
        if variant == "repeated":
            return repeated_logprobs(model, prompt, completion_ids, completion_mask, [G])
        if variant == "mmpg":
            return grouped_logprobs(model, prompt, completion_ids, completion_mask, [G], backend=case.get("backend"))
        return _upstream_logprobs(model, prompt, completion_ids)

    def step():
        model.zero_grad(set_to_none=True)
        loss = -(logprobs() * completion_mask).sum() / completion_mask.sum()
        loss.backward()

    info["tokens"] = G * (info["P"] + case["S"]) if variant == "repeated" else info["P"] + G * case["S"]
    return None, step, info
