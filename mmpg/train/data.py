"""The training sample stream: one global order shared by all ranks, each rank decoding its slice of every batch.

    epoch e: permutation of the N samples (seeded by trainer.seed + e; identity without shuffle)
    stream:  epoch 0 order, epoch 1 order, ...                           (infinite)
    global batch k of size B: stream[start + k*B : start + (k+1)*B]; rank r takes its B/W consecutive entries

With data.queries_per_video K > 1 each video's queries (annotation order) are cut into runs of at most K and the
runs, not the samples, are permuted, so up to K queries of one video sit side by side; each query still comes once
per epoch. Inside a global batch the ranks get whole videos (`pack_runs`: first fit in stream order, a video cut only
when it fits on no rank whole), so a video is decoded, encoded and prefilled by one rank and shares its prefix in the
grouped forward (`mmpg.grouping.shares`, `mmpg.train.batch.micro_batches`); the global batch itself does not change:

    global batch of 8, W = 2, runs  a a a | b | c c | d d      rank 0: a a a b    rank 1: c c d d
                      runs  a a a | b b b | c c                rank 0: a a a c    rank 1: b b b c   (c cut: no room)

Invariants: the order is a pure function of (seed, epoch), so `start` (the stream position) is all a checkpoint needs
to continue the data exactly, and a run on W ranks sees the same prompts in each step as one process with the same
global batch. The DataLoader's workers decode videos and build processor inputs; the main process only consumes.
"""

from __future__ import annotations

import torch
from torch.utils.data import Sampler

from mmpg.data.dataset import GroundingBatch, GroundingCollator, GroundingDataset, VideoDataLoader, video_key
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


def video_runs(videos: list, k: int) -> list[list[int]] | None:
    """Sample indices in runs of at most `k` queries of one video (each video's in annotation order); None for k 1.
    `videos`: what identifies each sample's video (`mmpg.data.dataset.video_key`: file and clip window)."""
    if k <= 1:
        return None
    by_video: dict = {}
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


def pack_runs(sizes: list[int], bins: int, capacity: int) -> list[list[tuple[int, int, int]]]:
    """Deal runs of consecutive items (sizes [R], in order, sum <= bins * capacity) into `bins` bins of `capacity`
    items: each run whole into the first bin with room for it; a run that fits in none is cut over the free places,
    in bin order. Returns per bin its pieces (run, start, stop) in run order. Deterministic: a pure function of the
    sizes, so every rank computes the same packing."""
    if sum(sizes) > bins * capacity:
        raise ValueError(f"{sum(sizes)} items do not fit in {bins} bins of {capacity}")
    room, out, cut = [capacity] * bins, [[] for _ in range(bins)], []
    for r, size in enumerate(sizes):
        b = next((b for b in range(bins) if room[b] >= size), None)
        if b is None:
            cut.append(r)
            continue
        out[b].append((r, 0, size))
        room[b] -= size
    for r in cut:
        start = 0
        for b in range(bins):
            take = min(room[b], sizes[r] - start)
            if take > 0:
                out[b].append((r, start, start + take))
                room[b] -= take
                start += take
    return [sorted(pieces) for pieces in out]


def runs_of(keys: list) -> list[list[int]]:
    """Positions 0..len(keys)-1 grouped by equal key, wherever they sit, groups in order of first appearance:
    [a, a, b, a] -> [[0, 1, 3], [2]] (a video's queries on both sides of an epoch boundary stay one group)."""
    out: dict = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return list(out.values())


def packed_slices(keys: list, bins: int, capacity: int) -> list[list[int]]:
    """Positions of `keys` dealt into `bins` bins of at most `capacity`, the positions of one key whole in one bin
    where they fit (`pack_runs`); per bin its positions, each key's together, keys in order of first appearance."""
    runs = runs_of(keys)
    packed = pack_runs([len(r) for r in runs], bins, capacity)
    return [[i for r, a, b in pieces for i in runs[r][a:b]] for pieces in packed]


class RankBatchSampler(Sampler):
    """Yields this rank's slice of global batch k = 0, 1, ... (forever), starting at stream position `start`."""

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int, shuffle: bool, start: int = 0,
                 runs: list[list[int]] | None = None, videos: list | None = None):
        if n < 1:
            raise UserError("the training set is empty")
        if global_batch % world:
            raise UserError(f"data.batch_size={global_batch} is not divisible by the {world} ranks; every rank "
                            "must hold whole groups of an equal slice")
        self.n, self.batch, self.rank, self.world = n, global_batch, rank, world
        self.seed, self.shuffle, self.start, self.runs = seed, shuffle, start, runs
        # sample index -> what keeps it with others on one rank: its video (the runs of one video in a global batch,
        # e.g. on both sides of an epoch boundary, go to one rank together where they fit), else its run
        self.run_id = {i: (videos[i] if videos is not None else r) for r, run in enumerate(runs or []) for i in run}

    def __iter__(self):
        local = self.batch // self.world
        k = 0
        while True:
            begin = self.start + k * self.batch
            if self.runs is None:  # i.i.d. order: this rank's consecutive slice
                yield stream_indices(self.n, self.seed, self.shuffle, begin + self.rank * local, local)
            else:  # whole runs (videos) per rank where they fit
                batch = stream_indices(self.n, self.seed, self.shuffle, begin, self.batch, self.runs)
                part = packed_slices([self.run_id[i] for i in batch], self.world, local)[self.rank]
                yield [batch[j] for j in part]
            k += 1

    def __len__(self):  # infinite stream; DataLoader only needs this for len(), which the loop never asks
        return 2 ** 62


def make_train_loader(samples, spec: VideoSpec, processor, template, *, global_batch: int, rank: int, world: int,
                      seed: int, shuffle: bool, start: int, num_workers: int, strict: bool = False,
                      queries_per_video: int = 1, frame_cache=None, part: tuple[int, int] | None = None) -> TrainLoader:
    """An endless DataLoader of `GroundingBatch`es (this rank's slice of each global batch, left-padded inputs).
    Bad videos are never fatal in the workers; the trainer counts `batch.skipped` (or stops in strict mode).
    frame_cache: a `mmpg.data.frame_cache.FrameCache` (`mmpg.train.setup.frame_cache(cfg)`), or None.
    part: (rank, sp) of this process in its sequence-parallel group: each video decoded only for the temporal
    patches this rank encodes (`mmpg.data.dataset.GroundingDataset`), the batch's pixel rows only those; `rank`,
    `world` are then the data-parallel ones (the sp ranks of a group hold the same samples)."""
    runs = video_runs([video_key(s) for s in samples], queries_per_video)
    videos = [video_key(s) for s in samples]
    sampler = RankBatchSampler(len(samples), global_batch, rank, world, seed, shuffle, start, runs, videos)
    return TrainLoader(GroundingDataset(samples, spec, strict=False, cache=frame_cache, part=part),
                       batch_sampler=sampler,
                       num_workers=num_workers, collate_fn=GroundingCollator(processor, template, strict=strict),
                       persistent_workers=False, prefetch_factor=2 if num_workers > 0 else None)


class TrainLoader(VideoDataLoader):
    """The training stream's loader; `decode` builds a batch of other samples the same way, in this process (a
    global batch dealt again across ranks when a rank's whole slice was unusable, `GRPOStep._rebalance`)."""

    def decode(self, samples) -> GroundingBatch:
        dataset = GroundingDataset(samples, self.dataset.spec, cache=self.dataset.cache, part=self.dataset.part)
        return self.collate_fn(dataset.__getitems__(list(range(len(samples)))))  # each video decoded once
