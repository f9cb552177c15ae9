"""The training sample stream: one global order shared by all ranks, each rank decoding its slice of every batch.

    epoch e: permutation of the N samples (seeded by trainer.seed + e; identity without shuffle)
    stream:  epoch 0 order, epoch 1 order, ...                           (infinite)
    global batch k of size B: stream[start + k*B : start + (k+1)*B]; rank r takes its B/W consecutive entries

With data.queries_per_video K > 1 the epoch order keeps up to K queries of one video side by side: each video's
queries (annotation order) are cut into runs of at most K, and the runs, not the samples, are permuted. Each query
still comes once per epoch, the order is still a pure function of (seed, epoch), so a checkpoint's stream position
resumes it exactly; a run that straddles a batch or rank boundary is split there. Side by side, a video's queries
share its prefix in the grouped forward (`mmpg.grouping.tree`: the vision tower and every layer see it once).

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


def stream_indices(n: int, seed: int, shuffle: bool, start: int, count: int,
                   runs: list[list[int]] | None = None) -> list[int]:
    """Dataset indices at stream positions start .. start+count-1 (`runs`: see `video_runs`)."""
    out = []
    epoch, pos = divmod(start, n)
    order = _order(n, seed, shuffle, epoch, runs)
    while len(out) < count:
        if pos == n:
            epoch, pos = epoch + 1, 0
            order = _order(n, seed, shuffle, epoch, runs)
        take = min(n - pos, count - len(out))
        out += order[pos:pos + take]
        pos += take
    return out


def video_runs(videos: list[str], k: int) -> list[list[int]] | None:
    """Sample indices in runs of at most `k` queries of one video (each video's in annotation order); None for k 1."""
    if k <= 1:
        return None
    by_video: dict[str, list[int]] = {}
    for i, video in enumerate(videos):
        by_video.setdefault(video, []).append(i)
    return [idx[j:j + k] for idx in by_video.values() for j in range(0, len(idx), k)]


def _order(n: int, seed: int, shuffle: bool, epoch: int, runs: list[list[int]] | None = None) -> list[int]:
    if runs is None:
        if not shuffle:
            return list(range(n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    perm = range(len(runs)) if not shuffle else \
        torch.randperm(len(runs), generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return [i for r in perm for i in runs[r]]


class RankBatchSampler(Sampler):
    """Yields this rank's slice of global batch k = 0, 1, ... (forever), starting at stream position `start`."""

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int, shuffle: bool, start: int = 0,
                 runs: list[list[int]] | None = None):
        if n < 1:
            raise UserError("the training set is empty")
        if global_batch % world:
            raise UserError(f"data.batch_size={global_batch} is not divisible by the {world} ranks; every rank "
                            "must hold whole groups of an equal share")
        self.n, self.batch, self.rank, self.world = n, global_batch, rank, world
        self.seed, self.shuffle, self.start, self.runs = seed, shuffle, start, runs

    def __iter__(self):
        local = self.batch // self.world
        k = 0
        while True:
            begin = self.start + k * self.batch + self.rank * local
            yield stream_indices(self.n, self.seed, self.shuffle, begin, local, self.runs)
            k += 1

    def __len__(self):  # infinite stream; DataLoader only needs this for len(), which the loop never asks
        return 2 ** 62


def make_train_loader(samples, spec: VideoSpec, processor, template, *, global_batch: int, rank: int, world: int,
                      seed: int, shuffle: bool, start: int, num_workers: int, strict: bool = False,
                      queries_per_video: int = 1) -> DataLoader:
    """An endless DataLoader of `GroundingBatch`es (this rank's share of each global batch, left-padded inputs).
    Bad videos are never fatal in the workers; the trainer counts `batch.skipped` (or stops in strict mode)."""
    runs = video_runs([s.video for s in samples], queries_per_video)
    sampler = RankBatchSampler(len(samples), global_batch, rank, world, seed, shuffle, start, runs)
    return VideoDataLoader(GroundingDataset(samples, spec, strict=False), batch_sampler=sampler,
                           num_workers=num_workers, collate_fn=GroundingCollator(processor, template, strict=strict),
                           persistent_workers=False, prefetch_factor=2 if num_workers > 0 else None)
