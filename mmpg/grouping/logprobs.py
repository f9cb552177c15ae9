"""`grouped_forward` / `grouped_logprobs` (each prompt once, responses packed behind it) and `repeated_logprobs`
(the naive reference).

The logprobs are [N, S] float32 (float64 for a float64 model: its head is not rounded down) with entry [i, t] = log p(completion_ids[i, t] | prompt of row i, completion_ids[i, :t])
and 0 where completion_mask is 0. The grouped forward equals the repeated one up to float rounding (tests hold it
to 1e-5 on logprobs and 1e-4 relative on every gradient in float32). `grouped_forward` returns them with what the
forward packed (`GroupedLogprobs`); `grouped_logprobs` returns the tensor alone.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mmpg.grouping.adapters import completion_positions, packed_hidden_states, prefix_positions
from mmpg.grouping.shares import Share, find_shares, leaders_visuals, share_order
from mmpg.grouping.shares import pack_shares as pack
from mmpg.grouping.inputs import (
    VIDEO_PART, Completions, check_completions, check_whole_videos, completion_visuals_per_row, feature_inputs,
    merge_visuals, mm_token_type_ids, pad_token_id, parts_of, placeholder_token_ids, prompt_attention_mask,
    select_prompts, split_visuals_per_prompt,
)
from mmpg.grouping.backends import compute_dtype, resolve_backend
from mmpg.grouping.layout import GroupLayout, pick_rows
from mmpg.grouping.patch import apply_grouped_attention, base_model, grouping_state, model_kind
from mmpg.grouping.positions import use_qwen_positions
from mmpg.grouping.sequence import (
    SequenceShard, check_model_heads, group_size, sharded_head_logprobs, sharded_hidden_states, with_video_features,
)


def _token_logprobs(lm_head, hidden, targets, temperature):
    """hidden [n, H], targets [n] -> [n] float32 log-softmax of the LM head at the targets. The head is called as a
    module, so ZeRO-3 gathers and LoRA wrappers apply."""
    logits = lm_head(hidden)
    logits = logits if logits.dtype == torch.float64 else logits.float()  # float32 at least, float64 kept
    if temperature != 1.0:
        logits = logits / temperature
    targets = targets.to(logits.device)  # a no-op unless the head sits on another device (device_map)
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


_RECOMPUTE = {"head": True}  # `keep_head_logits` turns the head's recompute off


@contextlib.contextmanager
def keep_head_logits():
    """Inside: the LM head's chunks keep their logits for backward instead of recomputing them (the self-check's
    gradient probe: under ZeRO-3 a frozen head's weight, released after its forward, is not gathered again for a
    recompute run outside the training engine's backward)."""
    _RECOMPUTE["head"] = False
    try:
        yield
    finally:
        _RECOMPUTE["head"] = True


def head_logprobs(lm_head, hidden, targets, temperature=1.0, chunk_size=2048, *, calls: int | None = None
                  ) -> torch.Tensor:
    """LM head on `hidden` [n, H] only, in chunks of `chunk_size` rows (or in exactly `calls` chunks, some maybe
    empty: the ranks of a sequence-parallel group call the head alike). Under autograd each chunk is recomputed in
    backward, so peak memory holds one chunk of logits ([chunk, V]) instead of [n, V]."""
    out = []
    bounds = [(a, a + chunk_size) for a in range(0, hidden.shape[0], chunk_size)] if calls is None else \
        [(hidden.shape[0] * c // calls, hidden.shape[0] * (c + 1) // calls) for c in range(calls)]
    for start, stop in bounds:
        args = (lm_head, hidden[start:stop], targets[start:stop], temperature)
        if torch.is_grad_enabled() and _RECOMPUTE["head"]:
            out.append(checkpoint(_token_logprobs, *args, use_reentrant=False))
        else:
            out.append(_token_logprobs(*args))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (logits are divided by it), got {temperature}")


def _on_device(prompt_inputs, device) -> dict:
    """The processor output (on the CPU) moved to the model's device; non-tensors kept as they are."""
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in prompt_inputs.items()}


def _scatter_rows(flat: torch.Tensor, completions: Completions) -> torch.Tensor:
    """[sum L_i] -> [N, S] with zeros past each row's length."""
    n, s = completions.ids.shape
    lengths = torch.tensor(completions.lengths, device=flat.device)
    mask = torch.arange(s, device=flat.device)[None, :] < lengths[:, None]
    out = flat.new_zeros(n, s)
    return out.masked_scatter(mask, flat)


@dataclasses.dataclass
class GroupedLogprobs:
    """What one grouped forward returns: the logprobs [N, S] float32, the prompts it forwarded, the parts they were
    packed behind (fewer than `prompts` where a video's queries shared it) and the tokens of the packed row this rank
    held (the row, or its sequence-parallel shard)."""

    logprobs: torch.Tensor
    prompts: int
    shared_parts: int
    row_tokens: int

    @property
    def shared_prompts(self) -> int:
        """Prompts packed behind another prompt's shared part (perf/shared_prompts)."""
        return self.prompts - self.shared_parts


def grouped_logprobs(model, prompt_inputs, completion_ids, completion_mask, group_sizes, **options) -> torch.Tensor:
    """`grouped_forward(...).logprobs`: [N, S] float32."""
    return grouped_forward(model, prompt_inputs, completion_ids, completion_mask, group_sizes, **options).logprobs


def grouped_forward(model, prompt_inputs, completion_ids, completion_mask, group_sizes, *, backend=None,
                    temperature: float = 1.0, chunk_size: int = 2048, share: bool = True,
                    sequence_group=None, completion_visuals=None) -> GroupedLogprobs:
    """Each prompt (and its video) forwarded once with its responses packed behind it (`GroupedLogprobs`).

    prompt_inputs: processor output for B prompts (left or right padded). completion_ids/mask: [N, S] right-padded,
    rows of prompt b contiguous and in prompt order. group_sizes: [B] positive ints summing to N.
    backend: "sdpa" | "flash" | "flex" | "lse_reference"; default: the model's (`GroupingState.backend`).
    share: let adjacent prompts that begin alike (a video's queries) share that part (`mmpg.grouping.shares`); false
    forwards each prompt on its own. Prompts of one video anywhere in the batch share it: they are computed side by
    side (`mmpg.grouping.shares.share_order`) and the rows given back in the caller's order.
    sequence_group: a torch.distributed process group of sp ranks that hold the same inputs and share the packed row
    (`mmpg.grouping.sequence`); default the model's (`GroupingState.sequence_group`), None or size 1: one rank.
    completion_visuals: visual inputs inside the completions (a trajectory tree: each row a branch whose tool turns
    hold a zoom clip's frames), processor output for all rows' clips in row order or one dict per row
    (`mmpg.grouping.inputs.completion_visuals_per_row`); the vision tower encodes each clip once, its features land
    at its row's placeholders and the row's positions are the model's own for [prompt | completion]. Placeholders in
    a completion without them are refused. The logprobs cover every completion token (a caller's loss mask leaves
    out the tool turns)."""
    _check_temperature(temperature)
    model = base_model(model)  # a peft PeftModel: the transformers model inside it
    state = grouping_state(model)
    is_vl = model_kind(model) == "vl"
    row_visuals = _row_visuals(model, is_vl, completion_ids, completion_mask, completion_visuals)
    if sequence_group is None:
        sequence_group = state.sequence_group
    if group_size(sequence_group) > 1:
        check_model_heads(model, group_size(sequence_group))
    else:
        check_whole_videos(prompt_inputs, "the grouped forward on one rank")
    completions = check_completions(prompt_inputs, completion_ids, completion_mask, group_sizes,
                                    [] if row_visuals else placeholder_token_ids(model))
    apply_grouped_attention(model)
    device = model.get_input_embeddings().weight.device
    prompt_inputs = _on_device(prompt_inputs, device)
    backend = resolve_backend(backend or state.backend, device, compute_dtype(model, device))
    visuals = split_visuals_per_prompt(model, prompt_inputs) if is_vl else None
    order = share_order(visuals) if share and is_vl else list(range(len(completions.group_sizes)))
    if order != sorted(order):  # a video's prompts apart in the batch: computed side by side, given back in order
        rows = [i for b in order for i in completions.rows_of(b)]
        pad_id = pad_token_id(model)
        out = grouped_forward(model, select_prompts(model, prompt_inputs, order, pad_id), completion_ids[rows],
                              completion_mask[rows], [completions.group_sizes[b] for b in order], backend=backend,
                              temperature=temperature, chunk_size=chunk_size, share=True,
                              sequence_group=sequence_group,
                              completion_visuals=[row_visuals[i] for i in rows] if row_visuals else None)
        back = torch.tensor(rows, device=out.logprobs.device).argsort()
        return dataclasses.replace(out, logprobs=out.logprobs[back])
    prefixes = prefix_positions(model, prompt_inputs, visuals)
    visuals = visuals or [{} for _ in prefixes.ids]
    # prompts that begin alike (a video's queries) share that part in the packed row (mmpg.grouping.shares)
    shares = find_shares(prefixes, visuals, placeholder_token_ids(model), completions.group_sizes) if share else \
        [Share((b,), p.numel()) for b, p in enumerate(prefixes.ids)]
    row_positions = None
    if row_visuals:  # rows holding clips: their own positions; each row's prompt start from its prompt
        row_visuals = [_on_device(v, device) for v in row_visuals]
        row_starts = [prefixes.starts[b] for b in range(len(completions.group_sizes)) for _ in completions.rows_of(b)]
        row_positions = completion_positions(model, completions, row_visuals, row_starts)
    packed_ids, packed_pos, row_lens, row_skip = pack(prefixes, completions, shares, device,
                                                      row_positions=row_positions)
    layout = GroupLayout(prefix_lens=[s.length for s in shares], response_lens=row_lens, device=device,
                         backend=backend, row_skip=row_skip if any(any(k) for k in row_skip) else None,
                         deterministic=state.deterministic, kernel_dtype=state.kernel_dtype)
    visual_inputs = leaders_visuals(prompt_inputs, visuals, shares, completions, row_visuals)
    if group_size(sequence_group) > 1:  # the row cut over the sp ranks (mmpg.grouping.sequence)
        layout.sequence = SequenceShard(sequence_group, group_size(sequence_group), dist.get_rank(sequence_group),
                                        layout.total)
        hidden = sharded_hidden_states(model, visual_inputs, packed_ids, packed_pos, layout)  # [T_loc, H]
        flat = sharded_head_logprobs(head_logprobs, model.get_output_embeddings(), hidden, layout, packed_ids,
                                     temperature, chunk_size)
        row_tokens = layout.sequence.local
    else:
        hidden = packed_hidden_states(model, visual_inputs, packed_ids, packed_pos, layout)  # [T, H]
        # with device_map the last layer (and so `hidden`) may sit on another device than the embedding
        predictors = pick_rows(hidden, layout.for_device(hidden.device).predictor_index)  # [sum L_i, H]
        flat = head_logprobs(model.get_output_embeddings(), predictors, packed_ids[layout.target_index], temperature,
                             chunk_size)  # [sum L_i]
        row_tokens = layout.total
    return GroupedLogprobs(_scatter_rows(flat, completions), prompts=len(prefixes.ids), shared_parts=len(shares),
                           row_tokens=int(row_tokens))


def _row_visuals(model, is_vl: bool, completion_ids, completion_mask, completion_visuals) -> list[dict] | None:
    """Per completion row its clips' visual inputs (`completion_visuals_per_row`), None when no row holds any."""
    if completion_visuals is None:
        return None
    if not is_vl:
        raise ValueError(f"completion_visuals were given to {type(model).__name__}, a model without a vision tower")
    rows = completion_visuals_per_row(model, completion_ids, completion_mask, completion_visuals)
    return rows if any(rows) else None


def _clip_features(model, completion_ids, completion_mask, row_visuals: list[dict], group) -> list[dict]:
    """The rows' clips (whole on every rank) encoded by the sequence-parallel group as `with_video_features` encodes
    the prompts' videos, split per row again: features in place of pixels."""
    clips = merge_visuals(row_visuals)
    if clips.get("image_grid_thw") is not None:
        raise ValueError("the repeated forward from a rank's video parts takes video clips in completions, not images")
    grid = clips["video_grid_thw"]
    clips[VIDEO_PART] = grid.new_tensor([[0, 1]] * grid.shape[0])
    return completion_visuals_per_row(model, completion_ids, completion_mask,
                                      with_video_features(model, clips, group))


def _repeated_rows(model, prompt_inputs, completions: Completions, row_visuals: list[dict] | None = None) -> dict:
    """Model inputs for N rows [pad | prompt of row i | completion i], left-padded, visuals repeated per row (and
    behind them row i's own clips, `row_visuals`)."""
    ids, attn = prompt_inputs["input_ids"], prompt_attention_mask(prompt_inputs)
    is_vl = model_kind(model) == "vl"
    types = mm_token_type_ids(model, prompt_inputs) if is_vl else None
    visuals = split_visuals_per_prompt(model, prompt_inputs) if is_vl else None
    pad_id = pad_token_id(model)
    rows, row_types, per_row = [], [], []
    for b, group in enumerate(completions.group_sizes):
        for i in completions.rows_of(b):
            tokens = completions.tokens(i).to(ids.device)
            rows.append(torch.cat([ids[b][attn[b]], tokens]))
            if is_vl:
                own = row_visuals[i] if row_visuals else {}
                tail = mm_token_type_ids(model, {"input_ids": tokens}).to(types.dtype) if own else \
                    torch.zeros_like(tokens, dtype=types.dtype)
                row_types.append(torch.cat([types[b][attn[b]], tail]))
                per_row.append(merge_visuals([visuals[b], own]) if own else visuals[b])
    width = max(r.numel() for r in rows)
    batch = {
        "input_ids": torch.stack([F.pad(r, (width - r.numel(), 0), value=pad_id) for r in rows]),
        "attention_mask": torch.stack([F.pad(torch.ones_like(r), (width - r.numel(), 0)) for r in rows]),
    }
    if is_vl:
        batch["mm_token_type_ids"] = torch.stack([F.pad(t, (width - t.numel(), 0)) for t in row_types])
        for key in {k for v in per_row for k in v}:
            batch[key] = torch.cat([v[key] for v in per_row if key in v])
    return batch


def repeated_logprobs(model, prompt_inputs, completion_ids, completion_mask, group_sizes, *,
                      temperature: float = 1.0, sequence_group=None, completion_visuals=None) -> torch.Tensor:
    """The naive reference: every prompt and its video repeated G_b times, the model's own forward (Qwen2.5-VL on its
    trained mRoPE convention, `mmpg.grouping.positions`). [N, S] float32. Inputs whose videos each rank holds only
    its part of (`VIDEO_PART`) are encoded whole by the sequence-parallel group first (`with_video_features`;
    `sequence_group` default the model's) and passed as precomputed features (transformers >= 5.18).
    completion_visuals: as `grouped_forward`'s; row i forwards [prompt | completion i] with the prompt's visuals and
    then its own clips, the whole conversation as the model's own forward reads it."""
    _check_temperature(temperature)
    model = base_model(model)  # a peft PeftModel: the transformers model inside it
    use_qwen_positions(model)
    row_visuals = _row_visuals(model, model_kind(model) == "vl", completion_ids, completion_mask, completion_visuals)
    if parts_of(prompt_inputs):  # every rank holds its part of the pixels: the group encodes the whole videos
        group = sequence_group if sequence_group is not None else grouping_state(model).sequence_group
        if group_size(group) <= 1:
            check_whole_videos(prompt_inputs, "the repeated forward on one rank")
        prompt_inputs = with_video_features(model, prompt_inputs, group)
        if row_visuals:  # the clips as features too (one forward takes pixels or features, not both)
            row_visuals = _clip_features(model, completion_ids, completion_mask, row_visuals, group)
    completions = check_completions(prompt_inputs, completion_ids, completion_mask, group_sizes,
                                    [] if row_visuals else placeholder_token_ids(model))
    device = model.get_input_embeddings().weight.device
    batch = _repeated_rows(model, _on_device(prompt_inputs, device), completions,
                           [_on_device(v, device) for v in row_visuals] if row_visuals else None)
    keep = max(completions.lengths) + 1
    batch = feature_inputs(model, batch)  # whole videos' features in place of pixels, where given
    logits = model(**batch, use_cache=False, logits_to_keep=keep).logits  # [N, keep, V]
    logits = logits if logits.dtype == torch.float64 else logits.float()  # float32 at least, float64 kept
    if temperature != 1.0:
        logits = logits / temperature
    logps = torch.log_softmax(logits, dim=-1)
    flat = []
    for i, length in enumerate(completions.lengths):
        # the completion occupies the last `length` positions; token t is predicted at keep - length - 1 + t
        pred = logps[i, keep - length - 1: keep - 1]
        flat.append(pred.gather(-1, completions.tokens(i).to(pred.device)[:, None])[:, 0])
    return _scatter_rows(torch.cat(flat), completions)
