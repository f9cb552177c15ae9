"""A torch Dataset that decodes videos for GroundingSamples, and the collate that drops the ones that failed.

Decoding runs in DataLoader workers. One bad file must never stop a run, so `__getitem__` does not raise on a
missing, empty, unreadable or corrupt video, or on a span that does not fit the duration read from the file: it
returns a `VideoItem` with `error` set, and the collate leaves it out, logs it (logger `mmpg.data`) and lists it in
`GroundingBatch.skipped` so the trainer can count skips across workers.

Strict mode stops at the first such sample with one `UserError` line naming the sample and the file. It is raised
in the main process, never in a worker: torch re-raises a worker's exception wrapped in the worker's traceback
("Caught UserError in DataLoader worker process 0. Original Traceback ..."). So in a worker a strict dataset
returns the failed item like skip mode does, it travels back in `GroundingBatch.skipped`, and `GroundingLoader`
(what `make_dataloader` returns) raises when it hands out a batch with a skip. Called directly, or by a loader
with `num_workers=0`, a strict dataset raises at once from `__getitem__` (same message). A plain `DataLoader` with
workers over a strict dataset would only skip: use `make_dataloader` / `GroundingLoader`.

    samples --GroundingDataset[i]--> VideoItem(sample, video | None, error)           (worker or main process)
            (a batch's indices at once, `__getitems__`: each distinct video decoded once, shared by its queries)
            --GroundingCollator-----> GroundingBatch(samples, videos, inputs?, skipped)  (worker or main process)
            --GroundingLoader-------> the batch, or UserError when strict and skipped    (main process)
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Sequence

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from mmpg.data.frame_cache import FrameCache
from mmpg.data.prompts import PromptTemplate, build_prompt_inputs
from mmpg.data.samples import GroundingSample, Skip, fit_span, span_problem
from mmpg.data.video import (DecodedVideo, VideoError, VideoPart, VideoSpec, _first_line, load_video,
                             load_video_part)
from mmpg.errors import UserError

log = logging.getLogger("mmpg.data")


@dataclasses.dataclass
class VideoItem:
    """One dataset item: the sample (duration filled in from the file if it was missing) and its frames, or the
    reason it cannot be used."""

    sample: GroundingSample
    video: DecodedVideo | VideoPart | None
    error: str | None = None
    source: str | None = None
    """How the video was had, on the first usable item of each distinct video of a batch: "decoded" (from its file)
    or "cached" (from the frame cache); None on the others (GroundingBatch.decode_stats counts each video once)."""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class GroundingBatch:
    """B usable samples, their decoded videos, and the processor inputs when the collator was given a processor.

    `inputs` holds input_ids / attention_mask [B, P] (left padded), pixel_values_videos, video_grid_thw [B, 3],
    ...; it is None when there is no processor or when every sample of the batch was skipped (B = 0).
    """

    samples: list[GroundingSample]
    videos: list[DecodedVideo]
    inputs: object | None
    skipped: list[Skip]
    decode_stats: dict = dataclasses.field(default_factory=dict)
    """How this batch's distinct videos were had: {"decoded": read from their files, "cached": read from the frame
    cache (`data.frame_cache`)}, each distinct video of the batch once, a failed one in neither; empty when not
    counted."""

    decoded_frames: int = 0
    """Frames this process decoded from files for the batch (each distinct video once; under sequence parallelism
    only this rank's part of each: `GroundingDataset(part=)`); 0 for videos read from the frame cache."""

    def __len__(self) -> int:
        return len(self.samples)


def video_key(sample: GroundingSample) -> tuple:
    """What identifies the frames of a sample's video under one frame spec: the file and the clip window. Queries
    with the same key get the same frames (decoded once per batch) and can share the video's work."""
    return sample.video, sample.clip_start, sample.clip_end


STAND_IN_VIDEO = "<lockstep stand-in>"  # the path a stand-in's blank video carries (no file)


def stand_in_batch(processor, template: str | PromptTemplate | None = None) -> GroundingBatch:
    """One prompt about a black two-frame video of one merged patch per frame (no file read): what a rank with
    nothing usable in a round forwards while sharded weights (ZeRO-3) need every rank in every forward. Its
    answer or loss is dropped; it only runs the same modules (vision tower, then the decoder) as a real batch."""
    vp = processor.video_processor
    side = vp.patch_size * vp.merge_size
    video = DecodedVideo(frames=torch.zeros(2, 3, side, side), timestamps=[0.0, 0.5], sample_fps=2.0,
                         metadata={"fps": 2.0, "frames_indices": [0, 1], "total_num_frames": 2,
                                   "video_backend": "none"}, path=STAND_IN_VIDEO, duration=1.0)
    sample = GroundingSample(sample_id="stand-in", video=STAND_IN_VIDEO, duration=1.0, query="nothing",
                             span=(0.0, 1.0), origin="lockstep stand-in")
    return GroundingBatch([sample], [video], build_prompt_inputs(processor, [sample], [video], template), [])


def strict_error(skip: Skip) -> UserError:
    """The one-line error of strict mode for a sample that cannot be used."""
    return UserError(f"{skip.where}: {skip.reason}; fix or remove this sample, or turn strict off to skip it")


class GroundingDataset(Dataset):
    """Decodes `samples[i]`'s video with `spec`; never raises on bad data unless `strict`, and then only outside
    DataLoader workers (in a worker the failed item is returned; `GroundingLoader` raises for it)."""

    def __init__(self, samples: Sequence[GroundingSample], spec: VideoSpec, strict: bool = False,
                 cache: FrameCache | None = None, part: tuple[int, int] | None = None):
        self.samples = list(samples)
        self.spec = spec
        self.strict = strict
        self.cache = cache  # decoded frames kept across epochs (`data.frame_cache`); None: decode every time
        # (rank, sp): decode only the frames sequence-parallel rank `rank` of `sp` encodes (`load_video_part`); the
        # items' videos are then `VideoPart`s and the collator builds inputs with only their pixel rows
        self.part = part if part is not None and part[1] > 1 else None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> VideoItem:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[VideoItem]:
        """The items of one batch (torch's fetcher calls this when it exists), each distinct video decoded once.

        Queries of one video (same file and clip window; the frame spec is the dataset's) get the very same
        `DecodedVideo`, so the processor sees identical pixels and the grouped forward and the rollout can share
        the video (`mmpg.grouping.shares`). A video that cannot be decoded fails each of its queries, one skip each."""
        decoded: dict[tuple, DecodedVideo | VideoPart | str] = {}  # (file, clip start, clip end) -> frames or why not
        uncounted: dict[tuple, str] = {}  # key -> "decoded" / "cached", until an item of the video is usable
        items = []
        for i in indices:
            sample = self.samples[i]
            key = video_key(sample)
            if key not in decoded:
                decoded[key], uncounted[key] = self._decode(sample)
            item = self._item(sample, decoded[key])
            if item.ok and key in uncounted:
                item.source = uncounted.pop(key)
            items.append(item)
        return items

    def _decode(self, sample: GroundingSample) -> tuple[DecodedVideo | VideoPart | str, str]:
        """(the frames of the sample's video (clip window) or the reason they cannot be had, "decoded" / "cached")."""
        clip = (sample.clip_start, sample.clip_end)
        try:
            if self.part is not None:
                rank, sp = self.part
                if self.cache is None:
                    return load_video_part(sample.video, self.spec, *clip, rank=rank, sp=sp), "decoded"
                video, hit = self.cache.load_part(sample.video, self.spec, *clip, rank=rank, sp=sp,
                                                  decode=load_video_part)  # this module's name: tests count the calls
                return video, "cached" if hit else "decoded"
            if self.cache is None:
                return load_video(sample.video, self.spec, *clip), "decoded"
            video, hit = self.cache.load(sample.video, self.spec, *clip,
                                         decode=load_video)  # this module's name: tests count the calls
            return video, "cached" if hit else "decoded"
        except VideoError as e:
            return str(e), "decoded"
        except Exception as e:  # anything else a broken file can trigger inside a decoder: still a skip
            return f"{sample.video}: unexpected error while decoding ({_first_line(e)})", "decoded"

    def _item(self, sample: GroundingSample, video: DecodedVideo | VideoPart | str) -> VideoItem:
        if isinstance(video, str):
            return self._fail(sample, video)
        duration = sample.duration if sample.duration is not None else video.duration
        problem = span_problem(sample.span, duration)  # the loader's rule (mmpg.data.samples), now with a duration
        if problem is not None and not sample.as_written:  # as_written: evaluated as a paper's code does, kept
            return self._fail(sample, f"{sample.video}: {problem[1]}")
        span, raw = fit_span(sample.span, duration) if problem is None else (sample.span, None)
        sample = dataclasses.replace(sample, duration=duration, span=span, raw_span=sample.raw_span or raw)
        return VideoItem(sample, video)

    def _fail(self, sample: GroundingSample, reason: str) -> VideoItem:
        if self.strict and get_worker_info() is None:
            raise strict_error(Skip(sample.where, reason))
        return VideoItem(sample, None, reason)


class GroundingCollator:
    """Drops failed items (logging each, unless `strict`: then the loader raises for them), and builds processor
    inputs for the rest when given a processor."""

    def __init__(self, processor=None, template: str | PromptTemplate | None = None, strict: bool = False):
        self.processor = processor
        self.template = template
        self.strict = strict

    def __call__(self, items: list[VideoItem]) -> GroundingBatch:
        good = [it for it in items if it.ok]
        skipped = [Skip(it.sample.where, it.error) for it in items if not it.ok]
        for skip in skipped if not self.strict else ():
            log.warning("skipped %s: %s", skip.where, skip.reason)
        samples, videos = [it.sample for it in good], [it.video for it in good]
        inputs = None
        if self.processor is not None and good:
            inputs = build_prompt_inputs(self.processor, samples, videos, self.template)
        stats = {k: sum(it.source == k for it in good) for k in ("decoded", "cached")}  # each distinct video once
        frames = sum(int(it.video.frames.shape[0]) for it in good if it.source == "decoded")
        return GroundingBatch(samples=samples, videos=videos, inputs=inputs, skipped=skipped, decode_stats=stats,
                              decoded_frames=frames)


def collate_grounding(items: list[VideoItem]) -> GroundingBatch:
    """Collate without a processor (frames and samples only)."""
    return GroundingCollator()(items)


class VideoDataLoader(DataLoader):
    """A DataLoader whose workers never collect garbage they inherited: it forks them with the garbage collector
    frozen. Such garbage can hold a decord VideoReader (an exception's traceback keeps the frame that held it, e.g.
    one a caller kept), and decord aborts a forked worker that frees one ("DataLoader worker ... is killed by signal:
    Aborted" while the collector runs in the worker). Garbage is collected here first, so only live objects
    are frozen, and they are unfrozen once the workers exist. Every loader that decodes videos in workers is one."""

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        gc.collect()
        gc.freeze()
        try:
            return super().__iter__()  # forks the workers (the first time, with persistent_workers)
        finally:
            gc.unfreeze()


class GroundingLoader(VideoDataLoader):
    """A DataLoader of `GroundingBatch`es that, when `strict`, raises `strict_error` in the main process for the
    first skipped sample of a batch (see the module docstring for why not in the worker)."""

    def __init__(self, *args, strict: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.strict = strict

    def __iter__(self):
        for batch in super().__iter__():
            if self.strict and batch.skipped:
                raise strict_error(batch.skipped[0])
            yield batch


def make_dataloader(samples: Sequence[GroundingSample], spec: VideoSpec, batch_size: int, *, processor=None,
                    template: str | PromptTemplate | None = None, num_workers: int = 2, shuffle: bool = True,
                    seed: int = 0, strict: bool = False, cache: FrameCache | None = None) -> GroundingLoader:
    """A DataLoader of `GroundingBatch`es whose decoding (and processing, with a processor) runs in workers.

    strict: the first bad sample raises `UserError` (one line naming the sample and the file) while iterating,
    with or without workers; otherwise bad samples are skipped, logged and listed in `GroundingBatch.skipped`.
    cache: a `FrameCache` the frames are read from and kept in (None: every video decoded from its file)."""
    generator = torch.Generator().manual_seed(seed)
    return GroundingLoader(GroundingDataset(samples, spec, strict=strict, cache=cache), batch_size=batch_size,
                           shuffle=shuffle, num_workers=num_workers,
                           collate_fn=GroundingCollator(processor, template, strict), generator=generator,
                           persistent_workers=num_workers > 0, strict=strict)
