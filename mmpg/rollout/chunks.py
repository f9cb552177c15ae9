"""Chunked prefill of long prompts: the activation peak follows the chunk, not the video.

A prompt of P tokens is prefilled as ceil(P / C) forwards of C = `prefill_chunk` tokens, each with use_cache:

    chunk k = tokens [kC, (k+1)C):   queries [B, C]  x  keys = cache [B, kC] ∪ itself (causal)   -> cache [B, (k+1)C]

Exact up to the order of float sums (float32: ~1e-6 on the logprobs): attention is a softmax over the same keys with
the same scores as the one-forward prefill, and every other op of a decoder layer is per token. On the CPU the
chunk's attention is `cascade_attention.chunk_attention` (cached and own keys merged by log-sum-exp, O(C·(H + K/V))
memory, never a [C, P] mask); elsewhere the model's own attention with its mask, until the cascade CUDA kernels have
run on a GPU. Positions are the whole prompt's, cut per chunk; only the last chunk's last token feeds the LM head.
Under video sharing the shared parts are prefilled in chunks, then the queries' tails behind them
(`mmpg.rollout.shares`).

The vision tower in frame chunks: Qwen-VL vision attention never crosses a temporal patch group, and a video's pixel
rows are ordered by group, so encode(video (t, h, w)) = concat_i encode(slice_i (t_i, h, w)) with Σ t_i = t
(`encode_in_chunks`). The merged features are kept once, and each chunk hands the model the rows of its own
placeholder tokens as `mm_encoder_outputs` (transformers >= 5.18), in the row-major order of the placeholders in the
[B, L] batch, the order the model's `masked_scatter` uses.
"""

from __future__ import annotations

import dataclasses

import torch

from mmpg.grouping.inputs import (  # noqa: F401 - supports_encoder_outputs: this module's callers read it here
    VIDEO_DEEPSTACK, VIDEO_FEATURES, supports_encoder_outputs, vision_output_class,
)

# (modality, pixel key, grid key, config attribute of the placeholder id, the model's feature method)
_MODALITIES = (("image", "pixel_values", "image_grid_thw", "image_token_id", "get_image_features"),
               ("video", "pixel_values_videos", "video_grid_thw", "video_token_id", "get_video_features"))


def chunk_spans(length: int, chunk: int) -> list[tuple[int, int]]:
    """[0, length) cut into consecutive spans of `chunk` tokens (the last one shorter); one span when chunk <= 0."""
    if chunk <= 0 or length <= chunk:
        return [(0, length)]
    return [(a, min(a + chunk, length)) for a in range(0, length, chunk)]


@dataclasses.dataclass
class EncodedVisuals:
    """The vision tower's output for one modality of a batch, kept once for all prefill chunks."""

    cls: type  # the model's own output class (BaseModelOutputWithPooling or Qwen3-VL's with deepstack features)
    features: torch.Tensor  # [N_vis, H] merged features, visual tokens in the batch's row-major order
    deepstack: list[torch.Tensor] | None  # per deepstack tap [N_vis, H] (Qwen3-VL), else None
    token_id: int  # the placeholder id these features replace
    modality: str  # "image" or "video": its key in `mm_encoder_outputs`

    def for_span(self, ids: torch.Tensor, a: int, b: int):
        """The output object for the placeholders of columns [a, b) of ids [B, L], or None when there are none."""
        mask = ids == self.token_id  # [B, L]
        order = mask.flatten().cumsum(0).view_as(mask) - 1  # [B, L] feature row of each placeholder
        rows = order[:, a:b][mask[:, a:b]]  # [n] in the chunk's row-major order
        if rows.numel() == 0:
            return None
        fields = {"pooler_output": (self.features[rows],)}
        if self.deepstack is not None:
            fields["deepstack_features"] = [(d[rows],) for d in self.deepstack]
        return self.cls(**fields)


def _pieces(grid: torch.Tensor, merge: int, max_tokens: int) -> list[tuple[int, int, list[int]]]:
    """Temporal slices of every item: (first pixel row, pixel rows, grid [t_i, h, w]) with t_i·h·w/merge² tokens <=
    max_tokens (at least one temporal group), items in order, slices in temporal order."""
    out, row = [], 0
    for t, h, w in grid.tolist():
        per_group = h * w // merge**2
        step = max(1, max_tokens // per_group) if max_tokens > 0 else t
        for t0 in range(0, t, step):
            ti = min(step, t - t0)
            out.append((row + t0 * h * w, ti * h * w, [ti, h, w]))
        row += t * h * w
    return out


def encode_in_chunks(model, pixels: torch.Tensor, grid: torch.Tensor, method: str, max_tokens: int):
    """The model's `method` (get_video_features / get_image_features) run on temporal slices of the items, several
    slices per call while their tokens fit in max_tokens. pixels [R, C·T·p·p]; grid [n, 3] -> (output class, merged
    features [N, H], deepstack features [N, H] per tap or None), N = Σ t·h·w / merge².

    Exact because no vision block crosses a temporal patch group: Qwen2.5-VL's window blocks attend inside windows of
    one group and its full-attention blocks use one cu_seqlens segment per group; Qwen3-VL's blocks use the same
    per-group segments, its position embedding and rotary index depend on (h, w) only, and its deepstack taps are
    per token (tested on both tiny families, float32)."""
    merge = model.config.vision_config.spatial_merge_size
    calls, current, tokens = [], [], 0
    for piece in _pieces(grid, merge, max_tokens):
        n = piece[1] // merge**2
        if current and max_tokens > 0 and tokens + n > max_tokens:
            calls.append(current)
            current, tokens = [], 0
        current.append(piece)
        tokens += n
    calls.append(current)
    feats, deep, cls = [], None, None
    fn = getattr(base_vl(model), method)
    for call in calls:
        px = pixels[call[0][0]: call[-1][0] + call[-1][1]]  # a view: a call's slices are consecutive pixel rows
        out = fn(px, torch.tensor([g for _, _, g in call], device=grid.device), return_dict=True)
        cls = type(out)
        feats.append(_joined(out.pooler_output))
        if getattr(out, "deepstack_features", None) is not None:
            deep = deep or [[] for _ in out.deepstack_features]
            for acc, tap in zip(deep, out.deepstack_features):
                acc.append(_joined(tap))
    return cls, torch.cat(feats), None if deep is None else [torch.cat(d) for d in deep]


def _joined(x) -> torch.Tensor:
    """Per-item features as one [N, H] tensor: transformers splits them per item in some releases (a tuple), not
    in others (5.17's Qwen3-VL deepstack features)."""
    return torch.cat(list(x)) if isinstance(x, (tuple, list)) else x


def encoder_outputs(model, visuals: dict, max_tokens: int) -> list[EncodedVisuals]:
    """Every modality present in `visuals` (processor keys for the prompts of one forward, in order) encoded in frame
    chunks of at most max_tokens merged tokens (0: each modality in one call)."""
    out = []
    if visuals.get(VIDEO_FEATURES) is not None:  # the videos' features, computed already (`with_video_features`)
        if not supports_encoder_outputs(model):
            raise RuntimeError(f"videos given as features need a {type(model).__name__} forward that takes them "
                               "(mm_encoder_outputs, transformers >= 5.18)")
        deep = visuals.get(VIDEO_DEEPSTACK)
        taps = None if deep is None else [deep[:, k] for k in range(deep.shape[1])]
        out.append(EncodedVisuals(vision_output_class(model, deep is not None), visuals[VIDEO_FEATURES], taps,
                                  model.config.video_token_id, "video"))
    for modality, pixel_key, grid_key, token_attr, method in _MODALITIES:
        if visuals.get(pixel_key) is None:
            continue
        cls, feats, deep = encode_in_chunks(model, visuals[pixel_key], visuals[grid_key], method, max_tokens)
        out.append(EncodedVisuals(cls, feats, deep, getattr(model.config, token_attr), modality))
    return out


def span_inputs(encoded: list[EncodedVisuals], ids: torch.Tensor, a: int, b: int) -> dict:
    """The forward kwargs of columns [a, b) of ids [B, L]: {"mm_encoder_outputs": {...}} or {} without visuals."""
    chunk = {}
    for enc in encoded:
        part = enc.for_span(ids, a, b)
        if part is not None:
            chunk[enc.modality] = part
    return {"mm_encoder_outputs": chunk} if chunk else {}


def base_vl(model):
    """The VL base model holding get_video_features (the ForConditionalGeneration's `.model`, or itself)."""
    return getattr(model, "model", model)
