"""The unit of GRPO work: one prompt with its G sampled responses, kept whole from rollout to update.

    GroundingBatch (b prompts, left-padded inputs) --rollout--> Rollout (N = b*G rows)
        --split_groups--> [PromptGroup] * b        (each: one prompt's unpadded inputs + its G rows)
        --collate_groups(k groups)--> MicroBatch   (inputs re-padded on the left, completions [k*G, S] right-padded)

A group never crosses a micro-batch or a rank (asserted in `collate_groups`): the grouped forward needs the whole
group behind its prefix, and group-normalised advantages need every reward of the group.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mmpg.data.dataset import video_key
from mmpg.data.samples import GroundingSample
from mmpg.grouping.inputs import pad_prompts, prompts_alone
from mmpg.train.data import packed_slices

_ROW_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


@dataclasses.dataclass
class PromptGroup:
    """One prompt and its G responses."""

    sample: GroundingSample
    video: object  # DecodedVideo (frames for thumbnails), or None once released
    inputs: dict  # this prompt alone: input_ids / attention_mask / mm_token_type_ids [1, P], its visual tensors
    completion_ids: torch.Tensor  # [G, S_b] right-padded
    completion_mask: torch.Tensor  # [G, S_b]
    rollout_logprobs: torch.Tensor  # [G, S_b] float32, the sampler's logprobs (0 outside the mask)
    texts: list[str]  # [G]
    finish_reasons: list[str]  # [G]
    rewards: list[dict] = dataclasses.field(default_factory=list)  # [G] reward components, "overall" included
    spans: list = dataclasses.field(default_factory=list)  # [G] [start_s, end_s] each answer names, None unparsed
    advantages: torch.Tensor | None = None  # [G] float32
    seed: int = 0  # the prompt seed its responses were drawn with
    policy_version: int | None = None  # the weights that sampled it: those after step policy_version (0: initial)
    train_logprobs: torch.Tensor | None = None  # [G, S_b] the update's first forward, no grad (rollout_logprobs)
    dummy: bool = False  # a copy rolled out only to keep a rank without a group of its own in lockstep: weight 0,
    # left out of the advantages' batch statistics, the metrics and the rollout records
    own_mask: torch.Tensor | None = None  # [G, S_b] multi-turn: 1 on the model's own tokens (the loss's), 0 on the
    # tool's turns (context); None: every completion token is the model's
    completion_visuals: list[dict] | None = None  # [G] multi-turn: each row's clips (`grouped_forward`'s
    # completion_visuals), None: no row holds any
    turns: list[list[str]] | None = None  # [G] multi-turn: each row's model turns (texts: its last one)
    tools: list[list] | None = None  # [G] multi-turn: each row's tool turns (`mmpg.rollout.zoom.ToolTurn`)

    @property
    def size(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def overall(self) -> torch.Tensor:
        """[G] float32 overall rewards."""
        return torch.tensor([r["overall"] for r in self.rewards], dtype=torch.float32)


@dataclasses.dataclass
class MicroBatch:
    """k whole groups ready for `grouped_logprobs` / `repeated_logprobs`."""

    groups: list[PromptGroup]
    inputs: dict  # processor-style inputs for k prompts, left-padded
    completion_ids: torch.Tensor  # [n, S] n = sum of the k group sizes
    completion_mask: torch.Tensor  # [n, S]
    group_sizes: list[int]  # [k]
    advantages: torch.Tensor  # [n]
    rollout_logprobs: torch.Tensor  # [n, S]
    truncated: torch.Tensor  # [n] bool: finish reason "length"
    own_mask: torch.Tensor  # [n, S] the model's own tokens (the loss's): completion_mask without the tool's turns
    completion_visuals: list[dict] | None = None  # [n] the rows' clips, None when no group has any
    dummy: bool = False  # a stand-in that keeps ranks in lockstep; its loss is multiplied by 0


def split_groups(model, batch, rollout, seeds: list[int]) -> list[PromptGroup]:
    """Cut a rolled-out batch into per-prompt groups (each prompt's inputs without padding)."""
    alone = prompts_alone(model, batch.inputs)
    own = getattr(rollout, "own_mask", None)  # multi-turn (`mmpg.rollout.multiturn.Trajectories`): tool turns
    groups, row = [], 0
    for b, g in enumerate(rollout.group_sizes):
        one = alone[b]
        rows = slice(row, row + g)
        width = int(rollout.completion_mask[rows].sum(dim=1).max())
        group = PromptGroup(
            sample=batch.samples[b], video=batch.videos[b], inputs=one,
            completion_ids=rollout.completion_ids[rows, :width], completion_mask=rollout.completion_mask[rows, :width],
            rollout_logprobs=(rollout.logprobs[rows, :width] if rollout.logprobs is not None
                              else torch.zeros(g, width)),
            texts=rollout.texts[rows], finish_reasons=rollout.finish_reasons[rows], seed=seeds[b])
        if own is not None:
            group.own_mask = own[rows, :width]
            group.completion_visuals = rollout.completion_visuals[rows]
            group.turns = rollout.turns[rows]
            group.tools = rollout.tools[rows]
        groups.append(group)
        row += g
    return groups


def _right_pad(t: torch.Tensor, width: int, value=0) -> torch.Tensor:
    return F.pad(t, (0, width - t.shape[-1]), value=value)


def collate_groups(groups: list[PromptGroup], pad_id: int) -> MicroBatch:
    """k groups -> one MicroBatch; prompts left-padded to the longest, completions right-padded to the longest."""
    assert groups, "a micro-batch needs at least one group"
    assert all(g.advantages is not None for g in groups), "advantages are computed before collating"
    inputs = pad_prompts([g.inputs for g in groups], pad_id)
    s = max(int(g.completion_ids.shape[1]) for g in groups)
    ids = torch.cat([_right_pad(g.completion_ids, s, pad_id) for g in groups])
    mask = torch.cat([_right_pad(g.completion_mask, s) for g in groups])
    sizes = [g.size for g in groups]
    assert sum(sizes) == ids.shape[0], "every group must be whole inside its micro-batch"
    own = torch.cat([_right_pad(g.completion_mask if g.own_mask is None else g.own_mask, s) for g in groups])
    visuals = None
    if any(g.completion_visuals is not None for g in groups):
        visuals = [v for g in groups for v in (g.completion_visuals or [{}] * g.size)]
    return MicroBatch(
        groups=groups, inputs=inputs, completion_ids=ids, completion_mask=mask, group_sizes=sizes,
        advantages=torch.cat([g.advantages for g in groups]),
        rollout_logprobs=torch.cat([_right_pad(g.rollout_logprobs, s) for g in groups]),
        truncated=torch.tensor([r == "length" for g in groups for r in g.finish_reasons]), own_mask=own,
        completion_visuals=visuals)


def micro_batches(groups: list[PromptGroup], size: int, pad_id: int) -> list[MicroBatch]:
    """ceil(k / size) micro-batches of at most `size` whole groups, in order; the adjacent groups of one video
    (the data layer puts a video's queries side by side) kept in one micro-batch where they fit, so the grouped
    forward shares the video among them (`mmpg.train.data.pack_runs`; a video too many for the room left is split,
    each part sharing within itself). A micro-batch of dummy groups only is a dummy micro-batch."""
    keys = [video_key(g.sample) for g in groups]
    slices = packed_slices(keys, -(-len(groups) // size), size) if groups else []
    out = [collate_groups([groups[i] for i in part], pad_id) for part in slices if part]
    for mb in out:
        mb.dummy = all(g.dummy for g in mb.groups)
    return out
