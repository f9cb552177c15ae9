"""Family adapters: prompt positions, and one packed forward of the model's own modules.

Positions (docs/ARCHITECTURE.md "Packed group layout"):
  * Qwen2.5-VL / Qwen3-VL: the prefix takes the model's own 3-D mRoPE index (`get_rope_index`; Qwen2.5-VL's on the
    convention its checkpoints were trained with, `mmpg.grouping.positions`); each response continues on all three
    axes where the model's own forward would put a text token after the prompt.
  * Qwen2 / Qwen3 text models: 1-D positions 0..P-1, responses from P.
The vision tower runs once on the B prompts' pixels: the packed row holds each prompt (and so each video's
placeholder tokens) once, so the B prompts' `pixel_values_videos` / `video_grid_thw` (and images') go to the model's
own forward unchanged, which encodes them, scatters the features and (Qwen3-VL) adds deepstack features itself, in
its own code (features encoded beforehand, `mm_encoder_outputs`, exist only from transformers 5.18; before, the
keyword falls through to the attention function unread). Positions are given explicitly, so the model never computes
its own index on the packed row.
Every input handed to the model for it to consume is named on the layout (`GroupLayout.model_inputs`), and the grouped
attention raises if one of them arrives in its kwargs (`mmpg.grouping.attention`, the tripwire).
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


def prefix_positions(model, prompt_inputs, visuals: list[dict] | None = None) -> Prefixes:
    """Positions of each prompt and where its responses start: exactly what the model's own forward gives the
    prompt followed by one response (the reference `repeated_logprobs` is that forward). `visuals`: the prompts'
    `split_visuals_per_prompt`, when the caller has it already.

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
    visuals = visuals if visuals is not None else split_visuals_per_prompt(model, prompt_inputs)
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


def completion_positions(model, completions, row_visuals: list[dict], starts: list[int]) -> list:
    """Positions [A, L_i] of each completion row that holds visual inputs (a trajectory's tool turns with a zoom
    clip's frames), None for a row of text alone (it continues at its prompt's start, 0, 1, 2, ...). starts[i]: the
    start of row i's prompt (`Prefixes.starts`).

    The model's own index of the row's tokens and clips, shifted to the prompt's start: every block of Qwen-VL's
    3-D index (a text run, an image, a video or, for Qwen3-VL, one frame) starts one past the largest position
    before it and is otherwise the same wherever it starts, so the tail of [prompt | completion] indexed whole equals
    the completion indexed alone plus the prompt's start (the trajectory-tree tests hold it against the whole
    conversation forwarded by the model itself)."""
    out = []
    for i, visuals in enumerate(row_visuals):
        if not any(k in visuals for k in ("video_grid_thw", "image_grid_thw")):
            out.append(None)
            continue
        out.append(row_positions(model, completions.tokens(i), visuals, starts[i]))
    return out


def row_positions(model, tokens: torch.Tensor, visuals: dict, start: int) -> torch.Tensor:
    """Positions [3, L] of one completion row `tokens` [L] (its clips' visual inputs `visuals`, {} for none) behind a
    prompt whose completions start at `start`: the model's own index of the row alone, shifted (`completion_positions`;
    the HF engine places a later turn's chunk with it, `HFEngine.continue_branches`)."""
    types = mm_token_type_ids(model, {"input_ids": tokens[None]})
    pos, _ = model.model.get_rope_index(
        tokens[None], mm_token_type_ids=types, image_grid_thw=visuals.get("image_grid_thw"),
        video_grid_thw=visuals.get("video_grid_thw"), second_per_grid_ts=visuals.get("second_per_grid_ts"))
    return pos[:, 0] + start


def _marker(device) -> torch.Tensor:
    # A 4-D tensor passes through every Qwen text model's mask creation untouched; the layout is the real mask.
    return torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)


# The processor keys of the visual inputs: consumed by the model's own forward (vision tower + scatter).
VISUAL_INPUTS = ("pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw")


def packed_hidden_states(model, prompt_inputs, packed_ids, packed_pos, layout: GroupLayout) -> torch.Tensor:
    """Final hidden states [T, H] of the packed row under the grouped attention."""
    inputs, position_ids = {}, packed_pos
    if model_kind(model) == "vl":
        inputs = {k: prompt_inputs[k] for k in VISUAL_INPUTS if prompt_inputs.get(k) is not None}
        position_ids = packed_pos[:, None, :]  # [3, 1, T]
    # The tripwire's keys: none of them may reach the attention function. Not among them: what transformers hands
    # every layer on purpose (position_ids, attention_mask, use_cache reach the attention call in some releases).
    layout.model_inputs = tuple(inputs)
    out = model.model(input_ids=packed_ids[None], position_ids=position_ids, attention_mask=_marker(packed_ids.device),
                      use_cache=False, **inputs, **{LAYOUT_KWARG: layout})
    return out.last_hidden_state[0]
