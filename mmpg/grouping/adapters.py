"""Family adapters: prompt positions, and one packed forward of the model's own modules.

Positions (ARCHITECTURE.md "Packed group layout"):
  * Qwen2.5-VL / Qwen3-VL: the prefix takes the model's own 3-D mRoPE index (`get_rope_index`, computed on the padded
    prompt batch exactly as the model's forward would); each response continues on all three axes at
    max(prefix positions) + 1, which is where generation continues (rope delta = max + 1 - length).
  * Qwen2 / Qwen3 text models: 1-D positions 0..P-1, responses from P.
The vision tower runs once on the B prompts' pixels; its output goes in through the model's `mm_encoder_outputs`
argument, so the model scatters features and (Qwen3-VL) adds deepstack features itself, in its own code.
"""

from __future__ import annotations

import torch

from mmpg.grouping.attention import LAYOUT_KWARG
from mmpg.grouping.inputs import mm_token_type_ids, prompt_attention_mask
from mmpg.grouping.layout import GroupLayout
from mmpg.grouping.patch import model_kind


def prefix_positions(model, prompt_inputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per prompt b: its unpadded ids [P_b] and positions [A, P_b] (A = 3 for mRoPE, 1 for text models)."""
    ids = prompt_inputs["input_ids"]
    attn = prompt_attention_mask(prompt_inputs)
    if model_kind(model) == "vl":
        pos, _ = model.model.get_rope_index(
            ids,
            mm_token_type_ids=mm_token_type_ids(model, prompt_inputs),
            image_grid_thw=prompt_inputs.get("image_grid_thw"),
            video_grid_thw=prompt_inputs.get("video_grid_thw"),
            second_per_grid_ts=prompt_inputs.get("second_per_grid_ts"),
            attention_mask=attn.long(),
        )  # [3, B, L]
    else:
        pos = ((attn.long().cumsum(dim=1) - 1).clamp(min=0))[None]  # [1, B, L]
    return [ids[b][attn[b]] for b in range(ids.shape[0])], [pos[:, b][:, attn[b]] for b in range(ids.shape[0])]


def pack(prefix_ids, prefix_pos, completions, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed row: ids [T] and positions [A, T] in the layout order (prefix_b, its responses, prefix_b+1, ...)."""
    ids, pos = [], []
    for b, (p_ids, p_pos) in enumerate(zip(prefix_ids, prefix_pos)):
        ids.append(p_ids.to(device))
        pos.append(p_pos.to(device))
        start = int(p_pos.max()) + 1
        for i in completions.rows_of(b):
            tokens = completions.tokens(i).to(device)
            ids.append(tokens)
            pos.append((start + torch.arange(tokens.numel(), device=device)).expand(p_pos.shape[0], -1))
    return torch.cat(ids), torch.cat(pos, dim=1)


def _marker(device) -> torch.Tensor:
    # A 4-D tensor passes through every Qwen text model's mask creation untouched; the layout is the real mask.
    return torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)


def encode_visuals(model, prompt_inputs) -> dict:
    """Run the vision tower once over the B prompts' videos and images: {"video": ..., "image": ...}."""
    enc = {}
    if prompt_inputs.get("pixel_values_videos") is not None:
        enc["video"] = model.model.get_video_features(
            prompt_inputs["pixel_values_videos"], prompt_inputs["video_grid_thw"], return_dict=True)
    if prompt_inputs.get("pixel_values") is not None:
        enc["image"] = model.model.get_image_features(
            prompt_inputs["pixel_values"], prompt_inputs["image_grid_thw"], return_dict=True)
    return enc


def packed_hidden_states(model, prompt_inputs, packed_ids, packed_pos, layout: GroupLayout) -> torch.Tensor:
    """Final hidden states [T, H] of the packed row under the grouped attention."""
    kwargs = {LAYOUT_KWARG: layout, "use_cache": False}
    if model_kind(model) == "vl":
        out = model.model(input_ids=packed_ids[None], position_ids=packed_pos[:, None, :],
                          attention_mask=_marker(packed_ids.device),
                          mm_encoder_outputs=encode_visuals(model, prompt_inputs) or None, **kwargs)
    else:
        out = model.model(input_ids=packed_ids[None], position_ids=packed_pos, attention_mask=_marker(
            packed_ids.device), **kwargs)
    return out.last_hidden_state[0]
