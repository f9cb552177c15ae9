"""Fill the decoded-frame cache (`mmpg.data.frame_cache`) for a list of samples with N processes, so the first
epoch reads frames instead of decoding them (`mmpg prepare-videos`).

Each distinct video (file and clip window, `video_key`) is decoded once, in a process of its own pool (forked, one
torch thread each: decoding is the work, and N processes already use N cores). A video that cannot be used is a
counted, logged failure, never a stop; a video whose entry is already whole in the cache is counted and left alone
(its checksum is checked when training reads it).

Memory: a process holds one video at a time, its frames at full size while qwen-vl-utils resizes them, then as
float32; at the long config that is ~3 GB a process for 720p (768 frames of 1280x720x3, then of 252x476x3x4 bytes).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

from mmpg.data.dataset import video_key
from mmpg.data.frame_cache import FrameCache, cache_key
from mmpg.data.video import VideoError, VideoSpec, _first_line, load_video

log = logging.getLogger("mmpg.data")

@dataclasses.dataclass
class PrepareCounts:
    """What one pass over the videos did."""

    decoded: int = 0  # decoded and stored now
    cached: int = 0  # already in the cache
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (video, reason)
    bytes: int = 0  # size of the entries of these videos (decoded and cached)

    @property
    def videos(self) -> int:
        return self.decoded + self.cached + len(self.failed)


_WORKER: dict = {}  # what a pool process works with: spec, cache (set by _init)


def _init(spec: VideoSpec, cache: FrameCache) -> None:
    import torch

    torch.set_num_threads(1)
    _WORKER.update(spec=spec, cache=cache)


def _fill(task: tuple) -> tuple[str, str, int]:
    """(status: decoded / cached / failed, reason, entry bytes) for one (file, clip start, clip end)."""
    path, clip_start, clip_end = task
    spec, cache = _WORKER["spec"], _WORKER["cache"]
    key = cache_key(path, spec, clip_start, clip_end)
    if key is not None and cache.has(key):
        return "cached", "", cache.entry_path(key).stat().st_size
    try:
        _, hit = cache.load(path, spec, clip_start, clip_end, decode=load_video)
    except VideoError as e:  # names the file and the reason
        return "failed", str(e), 0
    except Exception as e:  # noqa: BLE001 - anything else a broken file can trigger inside a decoder
        return "failed", f"{path}: unexpected error while decoding ({_first_line(e)})", 0
    try:
        size = cache.entry_path(key).stat().st_size if key else 0
    except OSError:  # not stored (logged by the cache) or already evicted under a small cap
        size = 0
    return ("cached" if hit else "decoded"), "", size


def prepare_videos(samples, spec: VideoSpec, cache: FrameCache, workers: int, progress: bool = True) -> PrepareCounts:
    """Decode each distinct video of `samples` into `cache` with `workers` processes (1: in this process)."""
    from tqdm.auto import tqdm

    tasks = list(dict.fromkeys(video_key(s) for s in samples))
    counts = PrepareCounts()
    bar = tqdm(total=len(tasks), desc="prepare-videos", unit="video", disable=not progress, dynamic_ncols=True)

    def record(task, result):
        status, reason, size = result
        if status == "failed":
            counts.failed.append((task[0], reason))
            log.warning("failed %s", reason)
        else:
            setattr(counts, status, getattr(counts, status) + 1)
            counts.bytes += size
        bar.update(1)
        bar.set_postfix(decoded=counts.decoded, cached=counts.cached, failed=len(counts.failed), refresh=False)

    if workers <= 1:
        _init(spec, cache)
        for task in tasks:
            record(task, _fill(task))
    else:
        _in_pool(tasks, spec, cache, workers, record)
    bar.close()
    return counts


def _in_pool(tasks, spec, cache, workers, record) -> None:
    # Forked with the garbage collector frozen, as the DataLoader's workers are (mmpg.data.dataset.VideoDataLoader:
    # a forked process that frees a decord reader it inherited aborts).
    gc.collect()
    gc.freeze()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_init,
                               initargs=(spec, cache))
    try:
        futures = {pool.submit(_fill, task): task for task in tasks}  # the processes are forked here
    finally:
        gc.unfreeze()
    done = set()
    try:
        for future in as_completed(futures):
            task = futures[future]
            try:
                result = future.result()
            except BrokenProcessPool:
                break
            done.add(task)
            record(task, result)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    for task in tasks:  # a process that died (killed, out of memory) took the unfinished videos with it
        if task not in done:
            record(task, ("failed", f"{task[0]}: a decoding process died before this video was done (out of memory? "
                                    "fewer --workers); rerun prepare-videos to finish (stored entries are kept)", 0))
