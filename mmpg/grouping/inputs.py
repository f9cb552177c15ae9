"""Checking and reshaping the public inputs: processor output for B prompts plus [N, S] completions.

Shared by the grouped and the repeated forward so both read the inputs the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import torch


@dataclasses.dataclass
class Completions:
    """Validated completions. N = sum(group_sizes) rows, rows of prompt b contiguous."""

    ids: torch.Tensor  # [N, S] long
    lengths: list[int]  # [N] valid tokens per row (the mask is 1 on exactly the first lengths[i] entries)
    group_sizes: list[int]  # [B]

    def rows_of(self, b: int) -> range:
        start = sum(self.group_sizes[:b])
        return range(start, start + self.group_sizes[b])

    def tokens(self, i: int) -> torch.Tensor:
        return self.ids[i, : self.lengths[i]]


def placeholder_token_ids(model) -> list[int]:
    """Image/video placeholder ids of a VL model (empty for text models): they stand for vision features, so a
    response holding one cannot be forwarded (the model would look for features that do not exist)."""
    config = model.config
    return [i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
            if i is not None]


def pad_token_id(model) -> int:
    """The padding id of `model`, the one rule for every place that pads: the rollout engines (finished rows of
    `Rollout.completion_ids`, left-padded prompts), the trainers' collators and the grouped and repeated forwards.

    generation_config.pad_token_id, else the text config's pad_token_id, else the first of generation_config's
    eos_token_id, else 0. Padding only fills positions a mask turns off (attention mask, completion mask), so any id
    of the vocabulary gives the same logprobs and losses; the order is `model.generate`'s (generation_config first,
    eos when no pad is set), so our rollouts are padded as transformers pads (Qwen checkpoints set <|endoftext|> in
    generation_config.json). 0 is for a bare config with neither pad nor eos: still an id of any vocabulary."""
    generation = getattr(model, "generation_config", None)
    for pad in (getattr(generation, "pad_token_id", None), model.config.get_text_config().pad_token_id):
        if pad is not None:
            return int(pad)
    eos = getattr(generation, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return int(eos) if eos is not None else 0


def check_completions(prompt_inputs, completion_ids, completion_mask, group_sizes,
                      banned_ids: list[int] = ()) -> Completions:
    """Raise a ValueError that names the row or prompt for every malformed input; return the parsed completions."""
    if "input_ids" not in prompt_inputs:
        raise ValueError("prompt_inputs needs 'input_ids' (the processor output for the B prompts)")
    num_prompts = prompt_inputs["input_ids"].shape[0]
    group_sizes = [int(g) for g in group_sizes]
    if len(group_sizes) != num_prompts:
        raise ValueError(f"{len(group_sizes)} group sizes for {num_prompts} prompts; give one group size per prompt")
    for b, g in enumerate(group_sizes):
        if g < 1:
            raise ValueError(f"group size of prompt {b} is {g}; every prompt needs at least one response")
    if completion_ids.dim() != 2 or completion_ids.shape != completion_mask.shape:
        raise ValueError(f"completion_ids {tuple(completion_ids.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must both be [N, S]")
    if sum(group_sizes) != completion_ids.shape[0]:
        raise ValueError(f"group sizes sum to {sum(group_sizes)} but there are {completion_ids.shape[0]} "
                         "completion rows")
    mask = completion_mask.bool()
    holes = mask[:, 1:] & ~mask[:, :-1]
    if holes.any():
        row = int(holes.any(dim=1).nonzero()[0])
        raise ValueError(f"completion_mask row {row} has a hole (a 1 after a 0); completions must be right-padded")
    lengths = mask.sum(dim=1).tolist()
    if 0 in lengths:
        raise ValueError(f"completion row {lengths.index(0)} is empty (all-zero mask); drop it or give it a token")
    for token in banned_ids:
        hit = (completion_ids == token) & mask
        if hit.any():
            row, col = (int(x) for x in hit.nonzero()[0])
            raise ValueError(f"completion row {row} holds the vision placeholder id {token} at token {col}; responses "
                             "cannot contain image/video placeholders (mmpg's rollout never samples them)")
    attn = prompt_inputs.get("attention_mask")
    if attn is not None and (attn.sum(dim=1) == 0).any():
        raise ValueError(f"prompt {int((attn.sum(dim=1) == 0).nonzero()[0])} is empty (all-zero attention_mask)")
    return Completions(completion_ids.long(), lengths, group_sizes)


def prompt_attention_mask(prompt_inputs) -> torch.Tensor:
    """[B, L] bool; all ones when the processor gave none."""
    attn = prompt_inputs.get("attention_mask")
    ids = prompt_inputs["input_ids"]
    return torch.ones_like(ids, dtype=torch.bool) if attn is None else attn.bool()


def mm_token_type_ids(model, prompt_inputs) -> torch.Tensor:
    """[B, L] 0 text, 1 image, 2 video. transformers 5 needs these for 3-D mRoPE; derived from the ids if absent."""
    given = prompt_inputs.get("mm_token_type_ids")
    if given is not None:
        return given
    ids = prompt_inputs["input_ids"]
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == model.config.image_token_id] = 1
    types[ids == model.config.video_token_id] = 2
    return types


# Per video [n_videos, 2] long: (rank, sp) when the video's pixel rows are only those of sequence-parallel rank `rank`
# of `sp` (its temporal patch groups [t rank / sp, t (rank + 1) / sp): `mmpg.data.prompts`, decoded per rank), (0, 1)
# for a whole video. Absent: every video whole. The grid is the whole video's either way (the prompt's placeholders
# and positions are the whole video's); only the pixel rows differ.
VIDEO_PART = "video_part"
# The whole videos' merged vision features in place of their pixels, one row per video placeholder token in item
# order: [N, H], and Qwen3-VL's deepstack taps [N, taps, H] (`mmpg.grouping.sequence.with_video_features`: sampling and
# the repeated reference when every rank holds only its part of the pixels). Split per prompt by tokens, not rows.
VIDEO_FEATURES = "video_features"
VIDEO_DEEPSTACK = "video_deepstack_features"
_TOKEN_KEYS = {"video": (VIDEO_FEATURES, VIDEO_DEEPSTACK), "image": ()}

_VISUALS = (
    # kind, placeholder token id attribute, grid key, pixel key, per-item extra keys
    ("video", "video_token_id", "video_grid_thw", "pixel_values_videos", ("second_per_grid_ts", VIDEO_PART)),
    ("image", "image_token_id", "image_grid_thw", "pixel_values", ()),
)


def part_span(t: int, rank: int, sp: int) -> tuple[int, int]:
    """Temporal patch groups [a, b) of a t-group video that rank `rank` of `sp` holds (the vision tower's split
    under sequence parallelism, `mmpg.grouping.sequence.frame_ranges`)."""
    return t * rank // sp, t * (rank + 1) // sp


def pixel_rows(prompt_inputs, grid_key: str = "video_grid_thw") -> list[int]:
    """Pixel rows each item of `grid_key` holds in the inputs: t h w, or (b - a) h w for a video held as one rank's
    part (`VIDEO_PART`)."""
    grid = prompt_inputs[grid_key]
    part = prompt_inputs.get(VIDEO_PART) if grid_key == "video_grid_thw" else None
    if part is None:
        return grid.prod(-1).tolist()
    if part.shape != (grid.shape[0], 2):
        raise ValueError(f"{VIDEO_PART} is {tuple(part.shape)} for {grid.shape[0]} videos; it must be [videos, 2]")
    out = []
    for (t, h, w), (rank, sp) in zip(grid.tolist(), part.tolist()):
        a, b = part_span(t, rank, sp)
        out.append((b - a) * h * w)
    return out


def parts_of(prompt_inputs) -> set[tuple[int, int]]:
    """The (rank, sp) of the videos held as parts (those with sp > 1); empty when every video is whole."""
    part = prompt_inputs.get(VIDEO_PART)
    return set() if part is None else {(r, s) for r, s in part.tolist() if s > 1}


def check_whole_videos(prompt_inputs, what: str) -> None:
    """A ValueError when some video of the inputs is held as one rank's part: `what` needs every pixel row."""
    parts = parts_of(prompt_inputs)
    if parts:
        rank, sp = sorted(parts)[0]
        raise ValueError(f"{what} needs whole videos, but these inputs hold rank {rank} of {sp}'s part of a video "
                         f"(decoded per sequence-parallel rank, `{VIDEO_PART}`)")


def supports_encoder_outputs(model) -> bool:
    """Whether the model's forward takes precomputed vision features (`mm_encoder_outputs`, transformers >= 5.18);
    a peft model's is the one of the model inside it (its own forward passes keywords through)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "mm_encoder_outputs" in inspect.signature(inner.forward).parameters


def vision_output_class(model, deepstack: bool) -> type:
    """The class of the vision tower's output that a Qwen-VL forward takes as precomputed features
    (`mm_encoder_outputs`, transformers >= 5.18): the model module's own with deepstack features (Qwen3-VL), else
    BaseModelOutputWithPooling."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    if not deepstack:
        return BaseModelOutputWithPooling
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: the one inside
    cls = getattr(sys.modules[type(inner).__module__], "BaseModelOutputWithDeepstackFeatures", None)
    if cls is None:
        raise RuntimeError(f"{type(model).__name__}: its module has no BaseModelOutputWithDeepstackFeatures, the "
                           "output class precomputed Qwen3-VL features travel in; use a supported transformers")
    return cls


def feature_inputs(model, inputs: dict) -> dict:
    """Model inputs with `VIDEO_FEATURES` (and `VIDEO_DEEPSTACK`) turned into the forward's `mm_encoder_outputs`:
    the features in the order of the batch's video placeholders (row-major), as the model scatters them."""
    out = {k: v for k, v in inputs.items() if k not in (VIDEO_FEATURES, VIDEO_DEEPSTACK)}
    feats = inputs.get(VIDEO_FEATURES)
    if feats is None:
        return out
    if not supports_encoder_outputs(model):
        raise RuntimeError(f"videos given as features need a {type(model).__name__} forward that takes them "
                           "(mm_encoder_outputs, transformers >= 5.18)")
    deep = inputs.get(VIDEO_DEEPSTACK)
    fields = {"pooler_output": (feats,)}
    if deep is not None:
        fields["deepstack_features"] = [(deep[:, k],) for k in range(deep.shape[1])]
    out["mm_encoder_outputs"] = {"video": vision_output_class(model, deep is not None)(**fields)}
    return out


def split_visuals_per_prompt(model, prompt_inputs, what: str = "prompt", first: int = 0
                             ) -> list[dict[str, torch.Tensor]]:
    """The visual inputs of each prompt: per prompt a dict with the same keys as the processor output, holding only
    that prompt's videos/images (in order). Items are assigned by counting each prompt's placeholder tokens. `what`
    and `first` name a row in the errors ("prompt" b, or "completion row" first + b for `completion_visuals_per_row`)."""
    ids = prompt_inputs["input_ids"]
    attn = prompt_attention_mask(prompt_inputs)
    merge = model.config.vision_config.spatial_merge_size
    per_prompt: list[dict[str, torch.Tensor]] = [{} for _ in range(ids.shape[0])]
    for kind, token_attr, grid_key, pixel_key, extra_keys in _VISUALS:
        grid = prompt_inputs.get(grid_key)
        if grid is None:
            stray = ((ids == getattr(model.config, token_attr)) & attn).sum(dim=1)
            if stray.any():
                b = int(stray.nonzero()[0])
                raise ValueError(f"{what} {first + b} has {int(stray[b])} {kind} tokens but no {grid_key} was given")
            continue
        tokens_per_item = (grid.prod(-1) // merge**2).tolist()
        # a video decoded per rank holds its part's rows only; features in place of pixels: none
        rows_per_item = pixel_rows(prompt_inputs, grid_key) if prompt_inputs.get(pixel_key) is not None else \
            [0] * len(tokens_per_item)
        counts = ((ids == getattr(model.config, token_attr)) & attn).sum(dim=1).tolist()
        item, row, token = 0, 0, 0
        for b, need in enumerate(counts):
            first_item, first_row, first_token, got = item, row, token, 0
            while got < need and item < len(tokens_per_item):
                got += tokens_per_item[item]
                row += rows_per_item[item]
                item += 1
            token += got
            if got != need:
                raise ValueError(f"{what} {first + b} has {need} {kind} tokens but its {kind} grids give {got}; "
                                 f"pass the processor output unchanged")
            if item > first_item:
                per_prompt[b][grid_key] = grid[first_item:item]
                if prompt_inputs.get(pixel_key) is not None:
                    per_prompt[b][pixel_key] = prompt_inputs[pixel_key][first_row:row]
                for key in _TOKEN_KEYS[kind]:  # features in place of pixels: a row per placeholder
                    if prompt_inputs.get(key) is not None:
                        per_prompt[b][key] = prompt_inputs[key][first_token:token]
                for key in extra_keys:
                    if prompt_inputs.get(key) is not None:
                        per_prompt[b][key] = prompt_inputs[key][first_item:item]
        where = f"{what} {first}" if ids.shape[0] == 1 else f"the {what}s"
        if item != len(tokens_per_item):
            raise ValueError(f"{len(tokens_per_item)} {kind}s given but the placeholders of {where} cover {item}")
        pixels = prompt_inputs.get(pixel_key)
        if pixels is not None and pixels.shape[0] != row:
            raise ValueError(f"{pixel_key} of {where} has {pixels.shape[0]} rows but the {kind} grids give {row}; "
                             "pass the processor output unchanged")
    return per_prompt


def completion_visuals_per_row(model, completion_ids, completion_mask, completion_visuals) -> list[dict]:
    """The visual inputs that sit inside completions (a trajectory's tool turns: a zoom clip's frames between the
    model's own tokens) -> one dict per completion row, as `split_visuals_per_prompt` gives per prompt.

    completion_visuals: processor output for the clips of all N rows, items in row order and within a row in
    placeholder order (`pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`, ...), or already one dict per
    row. A row's placeholder tokens must be exactly what its items' grids give (a ValueError names the row)."""
    if isinstance(completion_visuals, (list, tuple)):
        if len(completion_visuals) != completion_ids.shape[0]:
            raise ValueError(f"{len(completion_visuals)} completion visual dicts for {completion_ids.shape[0]} "
                             "completion rows; give one per row (empty for a row without clips)")
        for i, row in enumerate(completion_visuals):  # each row's placeholders against its own items
            split_visuals_per_prompt(model, {"input_ids": completion_ids[i:i + 1],
                                             "attention_mask": completion_mask[i:i + 1], **row},
                                     what="completion row", first=i)
        return [dict(v) for v in completion_visuals]
    inputs = {"input_ids": completion_ids, "attention_mask": completion_mask, **completion_visuals}
    return split_visuals_per_prompt(model, inputs, what="completion row")


def _has_videos(v: dict) -> bool:
    return v.get("video_grid_thw") is not None and v["video_grid_thw"].shape[0] > 0


def merge_visuals(items: list[dict]) -> dict:
    """Per-prompt (or per-row) visual dicts -> one processor-style dict with their items in that order, as the model
    scatters features at the placeholders of one row. A video held as one rank's part (`VIDEO_PART`) beside whole
    ones: the whole ones get (0, 1). A per-video key some videos have and others lack is a ValueError."""
    if any(_has_videos(v) and VIDEO_PART in v for v in items):
        items = [dict(v, **{VIDEO_PART: v["video_grid_thw"].new_tensor([[0, 1]] * v["video_grid_thw"].shape[0])})
                 if _has_videos(v) and VIDEO_PART not in v else v for v in items]
    have = [("second_per_grid_ts" in v) for v in items if _has_videos(v)]
    if any(have) and not all(have):
        raise ValueError("some videos carry second_per_grid_ts and others do not; give every video (the prompts' "
                         "and the completions') the processor's same keys")
    out: dict = {}
    for v in items:
        for k, x in v.items():
            out.setdefault(k, []).append(x)
    return {k: (x[0] if len(x) == 1 else torch.cat(x)) for k, x in out.items()}


_ROW_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


def prompts_alone(model, prompt_inputs) -> list[dict]:
    """Processor inputs of B prompts -> B dicts, each one prompt without padding ([1, P_b] rows, its own visual
    inputs, `split_visuals_per_prompt`)."""
    attn = prompt_attention_mask(prompt_inputs)
    visuals = split_visuals_per_prompt(model, prompt_inputs) if any(  # pixels, or features in their place
        prompt_inputs.get(k) is not None for _, _, k, _, _ in _VISUALS) else [{} for _ in range(attn.shape[0])]
    out = []
    for b in range(attn.shape[0]):
        one = {k: prompt_inputs[k][b:b + 1, attn[b]] for k in _ROW_KEYS if prompt_inputs.get(k) is not None}
        one.update(visuals[b])
        out.append(one)
    return out


def pad_prompts(prompts: list[dict], pad_id: int) -> dict:
    """`prompts_alone`'s dicts -> processor-style inputs for them, left-padded to the longest with `pad_id`."""
    width = max(int(p["input_ids"].shape[1]) for p in prompts)
    out: dict = {}
    for key in _ROW_KEYS:
        if key in prompts[0]:
            value = pad_id if key == "input_ids" else 0
            out[key] = torch.cat([torch.nn.functional.pad(p[key], (width - p[key].shape[-1], 0), value=value)
                                  for p in prompts])
    for key in sorted({k for p in prompts for k in p if k not in _ROW_KEYS}):
        parts = [p[key] for p in prompts if key in p]
        out[key] = parts[0] if len(parts) == 1 else torch.cat(parts)  # one prompt's patches: not copied again
    return out


def select_prompts(model, prompt_inputs, order: list[int], pad_id: int) -> dict:
    """The processor inputs of prompts `order` (indices into the B prompts, in that order), left-padded again."""
    alone = prompts_alone(model, prompt_inputs)
    return pad_prompts([alone[b] for b in order], pad_id)
