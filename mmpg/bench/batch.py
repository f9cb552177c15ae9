"""The bench's batch builders: seeded random prompts (`make_inputs`: one prompt with G completions; `make_batch`: B
prompts as one batch) and the shape a requested P becomes (`prompt_shape`). A text prompt is P random tokens; a VL
prompt holds one synthetic video given as patches (`pixel_values_videos`, `video_grid_thw`) after 8 text tokens, its
grid sized from P (`video_grid`) or fixed in pixels by the case's `video` (`pixel_grid`).
"""

from __future__ import annotations

import math

import torch

TEXT_IDS = 600  # random text tokens are drawn below this id (under the tokenizer's special tokens)


def forward_tokens(P: int, S: int, G: int, shared: bool) -> int:
    """Tokens in one forward over a group: the prompt once and G responses, or G rows of [prompt | response]."""
    return P + G * S if shared else G * (P + S)


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


def make_query_batch(model, case: dict, ids: dict, device, seed: int = 1) -> tuple[dict, dict]:
    """Q = case["Q"] queries of one video as one batch: every prompt is `make_inputs`' prompt (the shared part: text,
    the video, text; P tokens) followed by its own tail of t = case["t"] random tokens (the question and assistant
    header), drawn with seed 100 + q and starting with a token no other tail starts with, so the prompts agree on
    exactly P tokens. The video's patches repeat Q times, as a processor repeats them for Q prompts of one video.
    `seed`: `make_inputs`' (another seed: another video and text of the same shape). Returns (prompt_inputs with
    input_ids [Q, P + t], info of the shared part: its P and video sizes)."""
    prompt, _, _, info = make_inputs(model, case, ids, device, seed=seed)
    Q, t = case["Q"], case["t"]
    if t < 1 or Q < 1 or Q > TEXT_IDS:
        raise ValueError(f"queries per video Q={Q} and tail t={t} must be >= 1 (Q <= {TEXT_IDS})")
    tails = []
    for q in range(Q):
        tail = torch.randint(0, TEXT_IDS, (t,), generator=torch.Generator().manual_seed(100 + q))
        tail[0] = q  # distinct first tokens: the shared part ends exactly at P
        tails.append(tail.to(device))
    ids_q = torch.stack([torch.cat([prompt["input_ids"][0], tail]) for tail in tails])  # [Q, P + t]
    out = {"input_ids": ids_q, "attention_mask": torch.ones_like(ids_q)}
    if "video_grid_thw" in prompt:
        out["pixel_values_videos"] = prompt["pixel_values_videos"].repeat(Q, 1)
        out["video_grid_thw"] = prompt["video_grid_thw"].repeat(Q, 1)
        out["mm_token_type_ids"] = (ids_q == ids["video"]).to(torch.int32) * 2
    return out, info


def make_batch(model, case: dict, ids: dict, device) -> tuple[dict, dict]:
    """The case's B prompts (`B`, default 1) as one batch: prompt_inputs with input_ids [B, P] (equal lengths, no
    padding), videos' patches and grids concatenated; prompt b drawn with seed 1 + b (prompt 0 is `make_inputs`'
    own). Returns (prompt_inputs, info of one prompt: its P and video sizes)."""
    parts = [make_inputs(model, case, ids, device, seed=1 + b) for b in range(case.get("B", 1))]
    return {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}, parts[0][3]
