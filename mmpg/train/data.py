"""The training sample stream: one global order shared by all ranks, each rank decoding its slice of every batch.

    epoch e: permutation of the N samples (seeded by trainer.seed + e; identity without shuffle)
    stream:  epoch 0 order, epoch 1 order, ...                           (infinite)
    global batch k of size B: stream[start + k*B : start + (k+1)*B]; rank r takes its B/W consecutive entries

`start` (the stream position) is all a checkpoint needs to continue the data exactly where it stopped, and a run on
W ranks sees the same prompts in each step as a run on one process with the same global batch. The DataLoader's
workers decode videos (qwen-vl-utils, decord) and build processor inputs; the main process only consumes batches.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler

from mmpg.data.dataset import GroundingCollator, GroundingDataset, VideoDataLoader
from mmpg.data.video import VideoSpec
from mmpg.errors import UserError


def stream_indices(n: int, seed: int, shuffle: bool, start: int, count: int) -> list[int]:
    """Dataset indices at stream positions start .. start+count-1."""
    out = []
    epoch, pos = divmod(start, n)
    order = _order(n, seed, shuffle, epoch)
    while len(out) < count:
        if pos == n:
            epoch, pos = epoch + 1, 0
            order = _order(n, seed, shuffle, epoch)
        take = min(n - pos, count - len(out))
        out += order[pos:pos + take]
        pos += take
    return out


def _order(n: int, seed: int, shuffle: bool, epoch: int) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


class RankBatchSampler(Sampler):
    """Yields this rank's slice of global batch k = 0, 1, ... (forever), starting at stream position `start`."""

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int, shuffle: bool, start: int = 0):
        if n < 1:
            raise UserError("the training set is empty")
        if global_batch % world:
            raise UserError(f"data.batch_size={global_batch} is not divisible by the {world} ranks; every rank "
                            "must hold whole groups of an equal share")
        self.n, self.batch, self.rank, self.world = n, global_batch, rank, world
        self.seed, self.shuffle, self.start = seed, shuffle, start

    def __iter__(self):
        local = self.batch // self.world
        k = 0
        while True:
            begin = self.start + k * self.batch + self.rank * local
            yield stream_indices(self.n, self.seed, self.shuffle, begin, local)
            k += 1

    def __len__(self):  # infinite stream; DataLoader only needs this for len(), which the loop never asks
        return 2 ** 62


def make_train_loader(samples, spec: VideoSpec, processor, template, *, global_batch: int, rank: int, world: int,
                      seed: int, shuffle: bool, start: int, num_workers: int, strict: bool = False) -> DataLoader:
    """An endless DataLoader of `GroundingBatch`es (this rank's share of each global batch, left-padded inputs).
    Bad videos are never fatal in the workers; the trainer counts `batch.skipped` (or stops in strict mode)."""
    sampler = RankBatchSampler(len(samples), global_batch, rank, world, seed, shuffle, start)
    return VideoDataLoader(GroundingDataset(samples, spec, strict=False), batch_sampler=sampler,
                           num_workers=num_workers, collate_fn=GroundingCollator(processor, template, strict=strict),
                           persistent_workers=False, prefetch_factor=2 if num_workers > 0 else None)
