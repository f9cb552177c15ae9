"""Sampling under sequence parallelism: the sp ranks of a group hold the same prompts and split the work.

    group of sp ranks, B prompts:  rank r samples prompts [B r / sp, B (r+1) / sp), each with its own prompt seed
                                   -> the group gathers the sp rollouts -> every rank holds the B prompts' responses

Responses are seeded per prompt (`HFEngine.generate_groups(prompt_seeds=)`), so the texts equal what one process
samples for the whole batch, and no rank repeats another's rollout. Multi-turn trajectories with the zoom tool split
and join alike (`join_trajectories`), every branch seeded by its prompt, row and turn. A rank whose share is empty (B < sp) samples a
copy of the first prompt and drops it: under ZeRO-3 every rank must run the same forwards (the prefill and the
synced decode steps).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mmpg.grouping.inputs import select_prompts
from mmpg.rollout.engine import Rollout
from mmpg.rollout.multiturn import Trajectories


def share_of(n: int, size: int, rank: int) -> range:
    """The contiguous prompts [n r / size, n (r+1) / size) that rank r of a group of `size` samples."""
    return range(n * rank // size, n * (rank + 1) // size)


def sub_batch(model, batch, index: list[int], pad_id: int):
    """The GroundingBatch of the prompts at `index` (inputs re-padded on the left; nothing decoded again)."""
    return dataclasses.replace(batch, samples=[batch.samples[i] for i in index],
                               videos=[batch.videos[i] for i in index],
                               inputs=select_prompts(model, batch.inputs, index, pad_id), skipped=[])


def join_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rollouts of consecutive prompt shares -> one Rollout of all their prompts, in order (zoom trajectories:
    `join_trajectories`)."""
    if isinstance(parts[0], Trajectories):
        return join_trajectories(parts, pad_id)
    width = max(int(p.completion_ids.shape[1]) for p in parts)
    pad = lambda t, value=0: F.pad(t, (0, width - t.shape[1]), value=value)  # noqa: E731
    logprobs = torch.cat([pad(p.logprobs) for p in parts]) if all(p.logprobs is not None for p in parts) else None
    return Rollout(completion_ids=torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
                   completion_mask=torch.cat([pad(p.completion_mask) for p in parts]),
                   group_sizes=[g for p in parts for g in p.group_sizes],
                   texts=[t for p in parts for t in p.texts],
                   finish_reasons=[f for p in parts for f in p.finish_reasons],
                   logprobs=logprobs)


def join_trajectories(parts: list[Trajectories], pad_id: int) -> Trajectories:
    """Multi-turn trajectories of consecutive prompt shares -> one `Trajectories` of all their prompts, in order."""
    width = max(int(p.completion_ids.shape[1]) for p in parts)
    pad = lambda t, value=0: F.pad(t, (0, width - t.shape[1]), value=value)  # noqa: E731
    logprobs = torch.cat([pad(p.logprobs) for p in parts]) if all(p.logprobs is not None for p in parts) else None
    return Trajectories(completion_ids=torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
                        completion_mask=torch.cat([pad(p.completion_mask) for p in parts]),
                        own_mask=torch.cat([pad(p.own_mask) for p in parts]),
                        completion_visuals=[v for p in parts for v in p.completion_visuals],
                        group_sizes=[g for p in parts for g in p.group_sizes],
                        turns=[t for p in parts for t in p.turns], tools=[t for p in parts for t in p.tools],
                        finish_reasons=[f for p in parts for f in p.finish_reasons], logprobs=logprobs,
                        prefix_tokens=sum(p.prefix_tokens for p in parts))


def generate_split(generate, model, batch, seeds: list[int], pad_id: int, size: int, rank: int, gather) -> Rollout:
    """`generate(batch, seeds) -> Rollout` on this rank's slice of the batch; `gather(obj) -> [obj of each rank]`
    over the sequence-parallel group. Returns the whole batch's rollout on every rank of the group."""
    mine = list(share_of(len(batch), size, rank))
    own = generate(sub_batch(model, batch, mine or [0], pad_id), [seeds[i] for i in (mine or [0])])
    parts = gather(own if mine else None)
    return join_rollouts([p for p in parts if p is not None], pad_id)
