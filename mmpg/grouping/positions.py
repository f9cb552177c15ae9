"""Qwen2.5-VL's 3-D mRoPE index as the released checkpoints were trained with it: `use_qwen_positions(model)`.

In Qwen's own code (and vLLM, and transformers up to 5.2) every block of text or vision tokens starts one past the
largest position used so far: text after a video continues at max(video positions) + 1. transformers 5.3+ continues
instead at the video's start + max(H, W) / merge, which ignores the temporal axis. A video's temporal positions reach
(T - 1) * second_per_grid * tokens_per_second past its start (e.g. 2 * 59 = 118 for a minute at 2 fps), usually far
more than its spatial ones (e.g. 12 for a 336-pixel frame), so from the question after the video on, every token sits
where no released checkpoint ever saw it (on the tiny test model the logprobs of the same answer move by 1e-3; on a
trained 7B the question lands inside the video's time range), and vLLM, which keeps the trained convention, no
longer samples from the policy that training scores.

mmpg puts Qwen2.5-VL on the trained convention everywhere it forwards the model: the grouped forward, the repeated
reference, the HF rollout engine, evaluation and `generate` (all call the model's `get_rope_index`, which
`use_qwen_positions` replaces on that model instance). The vision positions themselves are the model's own
(`get_vision_position_ids`); only where each next block starts changes. Qwen3-VL needs nothing: its video frames
are separate one-frame blocks between timestamp text, and there max(H, W) / merge is max + 1 already.
"""

from __future__ import annotations

import itertools
import types

import torch

_TEXT, _IMAGE, _VIDEO = 0, 1, 2


def use_qwen_positions(model):
    """Give a Qwen2.5-VL model (the `...ForConditionalGeneration` or its inner `.model`) the trained convention's
    `get_rope_index`. Idempotent; any other model is returned unchanged. Returns the model."""
    inner = getattr(model, "model", model)
    if getattr(model.config, "model_type", None) != "qwen2_5_vl" or not hasattr(inner, "get_vision_position_ids"):
        return model
    if getattr(inner.get_rope_index, "__func__", None) is not qwen_rope_index:
        inner.get_rope_index = types.MethodType(qwen_rope_index, inner)
        inner.rope_deltas = None  # a delta cached under the old convention must not be reused
    return model


def qwen_rope_index(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor,
                    image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                    second_per_grid_ts: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and returns as transformers' `Qwen2_5_VLModel.get_rope_index`: position ids [3, B, L] (0 at
    padding) and rope deltas [B, 1] (max position + 1 - unpadded length, what `generate` continues from)."""
    vision = self.config.vision_config
    merge, per_second = vision.spatial_merge_size, vision.tokens_per_second
    grids = {_IMAGE: iter(image_grid_thw if image_grid_thw is not None else ()),
             _VIDEO: iter(video_grid_thw if video_grid_thw is not None else ())}
    spans = iter(second_per_grid_ts.tolist() if second_per_grid_ts is not None else ())
    device = input_ids.device
    position_ids = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype, device=device)
    deltas = []
    for b in range(input_ids.shape[0]):
        keep = attention_mask[b].bool() if attention_mask is not None else torch.ones_like(input_ids[b], dtype=bool)
        kinds = mm_token_type_ids[b][keep].tolist()
        blocks, start = [], 0
        for kind, run in itertools.groupby(kinds):
            left = len(list(run))
            while left:  # text: one block; vision: one block per image/video (adjacent ones share a run)
                if kind == _TEXT:
                    block, left = torch.arange(left, device=device).expand(3, -1) + start, 0
                else:
                    grid = next(grids[kind], None)
                    if grid is None:
                        raise ValueError(f"prompt {b} has more {'image' if kind == _IMAGE else 'video'} tokens than "
                                         "its grids describe (image_grid_thw / video_grid_thw)")
                    interval = per_second * next(spans, 1.0) if kind == _VIDEO else 1
                    block = _vision_positions(self, start, grid, merge, interval, device)
                    if block.shape[1] > left:
                        raise ValueError(f"prompt {b}: a grid of {block.shape[1]} tokens ({grid.tolist()}) but only "
                                         f"{left} placeholder tokens")
                    left -= block.shape[1]
                blocks.append(block)
                start = int(block.max()) + 1
        row = torch.cat(blocks, dim=1) if blocks else torch.zeros(3, 0, dtype=torch.long, device=device)
        position_ids[:, b, keep] = row.to(position_ids.dtype)
        deltas.append(start - len(kinds))
    return position_ids, torch.tensor(deltas, device=device).unsqueeze(1)


def _vision_positions(self, start: int, grid, merge: int, interval: float, device) -> torch.Tensor:
    """[3, T*H*W / merge^2] positions of one image/video block: the model's own `get_vision_position_ids` with a unit
    time interval, the temporal row then scaled and quantized here as transformers 5.18+ and Qwen's code do,
    start + floor(t * interval). transformers 5.17 multiplies by the interval without the cast (a float row that
    breaks its own meshgrid), so the interval is never handed to it; on 5.18+ this is bit-identical to passing it."""
    block = self.get_vision_position_ids(start, grid, 1, merge, 1, device=device)
    if interval != 1:
        block = block.clone()
        block[0] = start + ((block[0] - start) * interval).long()
    return block
