"""The grouped forward with its packed row spread over the sp ranks of a sequence-parallel group.

Every rank of the group holds the same prompts and completions and builds the same whole row (layout, mRoPE
positions, targets: `mmpg.grouping.logprobs`), padded to T_pad = sp * T_loc; rank r holds row[r T_loc : (r+1) T_loc],
a cut anywhere (inside a video, a question, a response).

    vision tower: rank r encodes temporal patch groups [t r / sp, t (r+1) / sp) of every video (Qwen-VL's vision
                  attention never crosses one); the merged (and deepstack) features are all-gathered in video order
    embeddings:   the shard's token embeddings, the features of its placeholders scattered in
    decoder:      the model's own text model on the shard; attention is Ulysses (`mmpg.grouping.ulysses`)
    LM head:      on the shard's own predictor positions; the [n] logprobs are summed over the group (zeros where
                  another rank fills them), so every rank holds all of them and computes the same loss

Gradients: the group computes sp copies of one loss, so every rank's parameter gradient is sp times its part and the
MEAN over the group is the one-process gradient, like data-parallel ranks that saw the same batch: a trainer averages
over all dp x sp ranks (DeepSpeed's default, every ZeRO stage) and scales the loss for the data-parallel size only.
Lockstep (ZeRO-3 gathers weights inside every forward): each rank encodes at least one temporal group (one left
without encodes the first again, weighted 0), and the LM head runs the same number of chunks on every rank.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmpg.grouping.attention import LAYOUT_KWARG
from mmpg.grouping.inputs import VIDEO_DEEPSTACK, VIDEO_FEATURES, VIDEO_PART, part_span, pixel_rows
from mmpg.grouping.layout import pick_rows
from mmpg.grouping.patch import base_model
from mmpg.grouping.ulysses import check_heads

_KINDS = (("image", "image_token_id", "pixel_values", "image_grid_thw", "get_image_features"),
          ("video", "video_token_id", "pixel_values_videos", "video_grid_thw", "get_video_features"))


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """Where this rank's shard of the packed row sits: tokens [lo, lo + local) of the row padded to `padded`."""

    group: object  # torch.distributed ProcessGroup of the sp ranks
    size: int  # sp
    rank: int  # this rank's index in the group
    total: int  # T, the real row length

    @property
    def padded(self) -> int:
        return math.ceil(self.total / self.size) * self.size

    @property
    def local(self) -> int:
        return self.padded // self.size

    @property
    def lo(self) -> int:
        return self.rank * self.local

    @property
    def hi(self) -> int:
        """End of this shard's real tokens (the padding after T is not in the row)."""
        return min(self.lo + self.local, self.total)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def check_model_heads(model, sp: int) -> None:
    """A ValueError naming the setting when the model's heads cannot be split over sp ranks."""
    text = model.config.get_text_config()
    q = text.num_attention_heads
    problem = check_heads(q, getattr(text, "num_key_value_heads", None) or q, sp)
    if problem:
        raise ValueError(problem)


class _SumRanks(torch.autograd.Function):
    """Sum over the group; every rank uses the sum, so the backward sums the ranks' gradients too (module
    docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Gather(torch.autograd.Function):
    """[n_r, H] on rank r -> [sum n_r, H] in rank order on every rank; the backward sums the ranks' gradients
    (each rank used the whole gather) and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, sizes: list[int], group):
        ctx.group, ctx.sizes, ctx.rank = group, sizes, dist.get_rank(group)
        width = max(sizes)
        parts = [x.new_empty(width, *x.shape[1:]) for _ in sizes]
        dist.all_gather(parts, F.pad(x, (0, 0, 0, width - x.shape[0])).contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[:ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


def frame_ranges(t: int, sp: int) -> list[tuple[int, int]]:
    """Temporal patch groups [a, b) of a t-group item that each of the sp ranks encodes."""
    return [part_span(t, r, sp) for r in range(sp)]


def _features(out) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The vision call's merged features [n, H] and deepstack features (Qwen3-VL) as [n, H] per tap."""
    emb = out.pooler_output
    emb = torch.cat(list(emb)) if isinstance(emb, (tuple, list)) else emb
    deep = getattr(out, "deepstack_features", None)
    if deep:
        deep = [torch.cat(list(d)) if isinstance(d, (tuple, list)) else d for d in deep]
    return emb, deep or None


def _encode_slices(inner, pixels, grid, getter: str, shard, part=None) -> tuple[torch.Tensor, list | None]:
    """This rank's temporal slices of every item, gathered over the group and put in item order.
    inner: the VL model holding `visual` (the ForConditionalGeneration's `.model`). pixels [sum t h w, C],
    grid [n, 3] -> features [sum t h w / merge^2, H] and deepstack taps alike. part: [n, 2] (rank, sp) per item
    (`mmpg.grouping.inputs.VIDEO_PART`) or None; an item held as a part holds only this rank's rows of its pixels
    (decoded per rank), and must be this rank's of this group."""
    sp = shard.size
    merge2 = inner.config.vision_config.spatial_merge_size ** 2
    rows_per_group = (grid[:, 1] * grid[:, 2]).tolist()
    ranges = [frame_ranges(int(t), sp) for t in grid[:, 0].tolist()]  # [item][rank] (a, b)
    held = [(0, 1)] * len(ranges) if part is None else [tuple(x) for x in part.tolist()]
    for i, (rank, size) in enumerate(held):
        if size > 1 and (rank, size) != (shard.rank, sp):
            raise ValueError(f"video {i}'s pixels were decoded for rank {rank} of a sequence-parallel group of {size}, "
                             f"but this is rank {shard.rank} of {sp}")
    mine, my_grid, row = [], [], 0
    for i, rng in enumerate(ranges):
        a, b = rng[shard.rank]
        whole = held[i][1] == 1
        if b > a:  # a whole item's slice [a, b); a part holds exactly that slice
            lo = row + (a * rows_per_group[i] if whole else 0)
            mine.append(pixels[lo: lo + (b - a) * rows_per_group[i]])
            my_grid.append([b - a, int(grid[i, 1]), int(grid[i, 2])])
        row += int(grid[i, 0]) * rows_per_group[i] if whole else (b - a) * rows_per_group[i]
    if row != pixels.shape[0]:
        raise ValueError(f"the videos' grids (and parts) give {row} pixel rows here, the inputs hold {pixels.shape[0]}")
    stand_in = not mine  # nothing of this rank's: encode one group (ZeRO-3 lockstep), weight 0
    if stand_in:  # the first group's rows, or zeros where this rank holds no pixel (its parts are all empty)
        first = pixels[:rows_per_group[0]]
        if first.shape[0] < rows_per_group[0]:
            first = pixels.new_zeros(rows_per_group[0], pixels.shape[1])
        mine, my_grid = [first], [[1, int(grid[0, 1]), int(grid[0, 2])]]
    frozen = not any(p.requires_grad for p in inner.visual.parameters())
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
        pixels_mine = mine[0] if len(mine) == 1 else torch.cat(mine)  # one slice: a view, not a copy
        emb, deep = _features(getattr(inner, getter)(pixels_mine, torch.tensor(my_grid, device=grid.device),
                                                     return_dict=True))
    if stand_in:
        emb, deep = emb[:0] + 0 * emb.sum(), ([d[:0] + 0 * d.sum() for d in deep] if deep else None)
    # sizes[r][i]: tokens of item i that rank r encoded
    sizes = [[(b - a) * rows_per_group[i] // merge2 for i, (a, b) in ((i, rng[r]) for i, rng in enumerate(ranges))]
             for r in range(sp)]
    order = _item_order(sizes)
    totals = [sum(s) for s in sizes]
    gather = (lambda x: _Gather.apply(x, totals, shard.group)[order])
    return gather(emb), ([gather(d) for d in deep] if deep else None)


def _item_order(sizes: list[list[int]]) -> torch.Tensor:
    """Index that turns the rank-major gather (rank 0's items, rank 1's items, ...) into item order."""
    offsets, pos = [], 0
    for per_rank in sizes:
        offsets.append(pos)
        pos += sum(per_rank)
    index = []
    for i in range(len(sizes[0])):
        for r, per_rank in enumerate(sizes):
            start = offsets[r] + sum(per_rank[:i])
            index.append(torch.arange(start, start + per_rank[i]))
    return torch.cat(index)


def _shard_embeddings(model, visual_inputs, packed_ids, shard) -> tuple[torch.Tensor, dict]:
    """[T_loc, H] input embeddings of this shard (zeros past the row) and the text model's deepstack kwargs.
    model: the inner model (VL: the one holding `visual` and `language_model`)."""
    lo, hi = shard.lo, shard.hi
    ids = packed_ids[lo:hi]
    embeds = model.get_input_embeddings()(ids)
    config, extra, masks, taps = model.config, {}, [], []
    for kind, token_attr, pixel_key, grid_key, getter in _KINDS:
        if visual_inputs.get(pixel_key) is None:
            continue
        token = getattr(config, token_attr)
        feats, deep = _encode_slices(model, visual_inputs[pixel_key], visual_inputs[grid_key], getter, shard,
                                     visual_inputs.get(VIDEO_PART) if kind == "video" else None)
        before = int((packed_ids[:lo] == token).sum())
        mask = ids == token
        n = int(mask.sum())
        embeds = embeds.masked_scatter(mask[:, None], feats[before:before + n].to(embeds.dtype))
        masks.append(mask)
        if deep:
            taps.append((mask, [d[before:before + n] for d in deep]))
    embeds = F.pad(embeds, (0, 0, 0, shard.local - embeds.shape[0]))
    if taps:  # Qwen3-VL: deepstack features added to the visual positions after the first layers
        visual = torch.stack(masks).any(0)
        joint = []
        for layer in range(len(taps[0][1])):
            out = embeds.new_zeros(int(visual.sum()), embeds.shape[-1])
            for mask, deep in taps:
                out = out.index_put((mask[visual].nonzero()[:, 0],), deep[layer].to(out.dtype))
            joint.append(out)
        extra = {"visual_pos_masks": F.pad(visual, (0, shard.local - visual.numel()))[None],
                 "deepstack_visual_embeds": joint}
    return embeds, extra


def sharded_hidden_states(model, visual_inputs: dict, packed_ids, packed_pos, layout) -> torch.Tensor:
    """Final hidden states [T_loc, H] of this rank's shard of the packed row (`layout.sequence`)."""
    shard = layout.sequence
    is_vl = hasattr(model.model, "language_model")
    text_model = model.model.language_model if is_vl else model.model
    embeds, extra = _shard_embeddings(model.model, visual_inputs if is_vl else {}, packed_ids, shard)
    pos = F.pad(packed_pos[:, shard.lo:shard.hi], (0, shard.local - (shard.hi - shard.lo)))
    position_ids = pos[:, None, :] if is_vl else pos  # [3, 1, T_loc] or [1, T_loc]
    layout.model_inputs = tuple(extra)  # the tripwire: these must be consumed by the text model
    marker = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=embeds.device)
    out = text_model(input_ids=None, inputs_embeds=embeds[None], position_ids=position_ids, attention_mask=marker,
                     use_cache=False, **extra, **{LAYOUT_KWARG: layout})
    return out.last_hidden_state[0]


def sharded_head_logprobs(head_fn, lm_head, hidden, layout, packed_ids, temperature, chunk_size) -> torch.Tensor:
    """[n scored] logprobs of the whole row on every rank of the group: each rank runs the LM head on its shard's
    predictor positions, in the same number of calls as every other rank, and the group sums the entries."""
    shard = layout.sequence
    pred = layout.for_device(hidden.device).predictor_index
    targets = packed_ids[layout.target_index]
    own = (pred >= shard.lo) & (pred < shard.hi)
    calls = max(1, math.ceil(pred.numel() / chunk_size))
    mine = head_fn(lm_head, pick_rows(hidden, pred[own] - shard.lo), targets[own.to(targets.device)], temperature,
                   calls=calls)
    flat = torch.zeros(pred.numel(), dtype=mine.dtype, device=mine.device).masked_scatter(own, mine)
    return _SumRanks.apply(flat, shard.group)


def with_video_features(model, prompt_inputs, group, keys: list | None = None) -> dict:
    """Inputs whose videos are held as this rank's parts (`VIDEO_PART`, decoded per rank) -> the same prompts with the
    whole videos' merged features (`VIDEO_FEATURES`; Qwen3-VL's deepstack taps, `VIDEO_DEEPSTACK`) in place of the
    pixels, on every rank of the group: each rank encodes its temporal patch groups and the group gathers them
    (`_encode_slices`), so no rank ever holds a whole video's pixels. `keys`: one per video, equal for the same video
    (a video asked several questions is encoded once), the same on every rank; None: each encoded on its own.
    Autograd records the encode when enabled (the gather's backward sums the ranks' gradients). What sampling from
    whole videos and the repeated reference take when every rank holds a part (`mmpg.rl.collect`, `repeated_logprobs`).
    """
    inner = base_model(model).model  # the VL model holding `visual` (a peft model: the transformers one inside)
    grid, part = prompt_inputs["video_grid_thw"], prompt_inputs[VIDEO_PART]
    pixels = prompt_inputs["pixel_values_videos"]
    n = grid.shape[0]
    keys = list(range(n)) if keys is None else list(keys)
    if len(keys) != n:
        raise ValueError(f"{len(keys)} video keys for {n} videos")
    merge2 = inner.config.vision_config.spatial_merge_size ** 2
    rows = pixel_rows(prompt_inputs)
    starts = [0] + torch.cumsum(torch.tensor(rows), 0).tolist()[:-1]
    first: dict = {}  # key -> index among the distinct videos
    for i, key in enumerate(keys):
        first.setdefault(key, len(first))
    leaders = [keys.index(k) for k in first]  # the first video of each key, in order
    lead_pixels = torch.cat([pixels[starts[i]: starts[i] + rows[i]] for i in leaders]) if leaders else pixels[:0]
    size = group_size(group)
    shard = SequenceShard(group, size, dist.get_rank(group), 0)
    emb, deep = _encode_slices(inner, lead_pixels, grid[leaders], "get_video_features", shard, part[leaders])
    tokens = (grid[leaders].prod(-1) // merge2).tolist()
    offsets = [0] + torch.cumsum(torch.tensor(tokens), 0).tolist()[:-1]
    pick = torch.cat([torch.arange(offsets[first[k]], offsets[first[k]] + tokens[first[k]]) for k in keys])
    pick = pick.to(emb.device)
    out = {k: v for k, v in prompt_inputs.items() if k not in ("pixel_values_videos", VIDEO_PART)}
    out[VIDEO_FEATURES] = emb[pick]
    if deep:
        out[VIDEO_DEEPSTACK] = torch.stack([d[pick] for d in deep], dim=1)  # [N, taps, H]
    return out
