"""Family adapters: prompt positions, and one packed forward of the model's own modules.

Positions (ARCHITECTURE.md "Packed group layout"):
  * Qwen2.5-VL / Qwen3-VL: the prefix takes the model's own 3-D mRoPE index (`get_rope_index`; Qwen2.5-VL's on the
    convention its checkpoints were trained with, `mmpg.grouping.positions`); each response continues on all three
    axes where the model's own forward would put a text token after the prompt.
  * Qwen2 / Qwen3 text models: 1-D positions 0..P-1, responses from P.
The vision tower runs once on the B prompts' pixels; its output goes in through the model's `mm_encoder_outputs`
argument, so the model scatters features and (Qwen3-VL) adds deepstack features itself, in its own code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mmpg.grouping.attention import LAYOUT_KWARG
from mmpg.grouping.inputs import (
    mm_token_type_ids,
    prompt_attention_mask,
    split_visuals_per_prompt,
)
from mmpg.grouping.layout import GroupLayout
from mmpg.grouping.patch import model_kind
from mmpg.grouping.positions import use_qwen_positions


class Prefixes(NamedTuple):
    """The B prompts unpadded: ids[b] [P_b], positions[b] [A, P_b] (A = 3 for mRoPE, 1 for text models), and
    starts[b], the position of the first response token on every axis."""

    ids: list[torch.Tensor]
    positions: list[torch.Tensor]
    starts: list[int]


def prefix_positions(model, prompt_inputs) -> Prefixes:
    """Positions of each prompt and where its responses start: exactly what the model's own forward gives the
    prompt followed by one response (the reference `repeated_logprobs` is that forward).

    VL: `get_rope_index` per prompt on [prompt | one text token]; the extra token's position is the start (last
    position + 1 for a prompt ending in text, which on the trained convention is also max(positions) + 1, where vLLM
    continues)."""
    ids = prompt_inputs["input_ids"]
    attn = prompt_attention_mask(prompt_inputs)
    rows = [ids[b][attn[b]] for b in range(ids.shape[0])]
    if model_kind(model) != "vl":
        return Prefixes(rows, [torch.arange(r.numel(), device=r.device)[None] for r in rows], [r.numel() for r in rows])
    use_qwen_positions(model)
    types = mm_token_type_ids(model, prompt_inputs)
    visuals = split_visuals_per_prompt(model, prompt_inputs)
    positions, starts = [], []
    for b, row in enumerate(rows):
        ext_ids = torch.cat([row, row[-1:]])[None]  # [1, P_b + 1]; the extra token's id is irrelevant, its type text
        ext_types = torch.cat([types[b][attn[b]], types.new_zeros(1)])[None]
        pos, _ = model.model.get_rope_index(
            ext_ids, mm_token_type_ids=ext_types, image_grid_thw=visuals[b].get("image_grid_thw"),
            video_grid_thw=visuals[b].get("video_grid_thw"), second_per_grid_ts=visuals[b].get("second_per_grid_ts"))
        positions.append(pos[:, 0, :-1])  # [3, P_b]
        starts.append(int(pos[0, 0, -1]))
    return Prefixes(rows, positions, starts)


def pack(prefixes: Prefixes, completions, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed row: ids [T] and positions [A, T] in the layout order (prefix_b, its responses, prefix_b+1, ...)."""
    ids, pos = [], []
    for b, (p_ids, p_pos, start) in enumerate(zip(*prefixes)):
        ids.append(p_ids.to(device))
        pos.append(p_pos.to(device))
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
