"""`mmpg prepare-videos --config CONFIG [key=value ...] [--workers N]`: decode the videos of a config's data.train
(and data.val) into its data.frame_cache before a run, so the first epoch reads frames instead of decoding them.

The frames are keyed exactly as training will ask for them: the same samples (`load_train_samples`: data.format,
data.max_samples; data.val as held-out evaluation loads it) and the same frame spec (`video_spec`: data.fps, frames,
pixels, and the patch size of model.path's family, read from its config.json).
"""

from __future__ import annotations

import os

from mmpg.errors import UserError

DEFAULT_MAX_WORKERS = 16  # the default number of processes is the usable cores, at most this (memory: --workers)


def default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, DEFAULT_MAX_WORKERS))


def add_arguments(p) -> None:  # no torch here: `mmpg --help` builds every parser
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml) naming data.train, data.videos, "
                   "data.frame_cache and model.path")
    p.add_argument("--workers", type=int, default=None, help=f"decoding processes (default: the usable cores, at "
                   f"most 16; here {default_workers()}); each holds one video, ~3 GB for 720p at the long config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.frame_cache=/local/frames")


def run(args) -> int:
    from mmpg.config import load_config

    cfg = load_config(args.config, list(args.overrides))
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers}: expected a positive integer")
    counts, cache = prepare(cfg, args.workers)
    size, entries = cache.size()
    print(f"{counts.videos} videos: {counts.decoded} decoded, {counts.cached} already cached, {len(counts.failed)} "
          f"failed; {cache.root}: {size / 1e9:.2f} GB in {entries} entries (cap {cache.max_bytes / 1e9:g} GB)")
    for path, reason in counts.failed[:20]:
        print(f"  failed: {reason}")
    if counts.bytes > cache.max_bytes:
        print(f"warning: these videos' frames take {counts.bytes / 1e9:.2f} GB, more than data.frame_cache_gb="
              f"{cfg.data.frame_cache_gb:g}: the oldest were evicted again; raise the cap or training decodes them")
    return 1 if counts.failed and not (counts.decoded or counts.cached) else 0


def prepare(cfg, workers: int | None = None, progress: bool = True):
    """(PrepareCounts, FrameCache) after filling the config's cache with its training (and held-out) videos."""
    from mmpg.data.prepare import prepare_videos
    from mmpg.data.video import PATCH_SIZE
    from mmpg.train.setup import _model_config, frame_cache, load_train_samples, video_spec

    cache = frame_cache(cfg)
    if cache is None:
        raise UserError("data.frame_cache is not set: name a folder on local disk (data.frame_cache=DIR), the one "
                        "training will read")
    family = (_model_config(cfg) or {}).get("model_type")
    if family not in PATCH_SIZE:
        raise UserError(f"model.path={cfg.model.path!r}: its config.json gives no video model family "
                        f"({', '.join(PATCH_SIZE)}; got {family!r}), which sets the frames' size; set model.path to "
                        "the checkpoint training will use")
    samples = list(load_train_samples(cfg))
    if cfg.data.val:
        from mmpg.data.formats import load_annotations

        val = load_annotations(cfg.data.val, cfg.data.videos or None, fmt=cfg.data.format, strict=False).samples
        samples += val[:cfg.eval.max_samples] if cfg.eval.max_samples > 0 else val  # as mmpg.train.heldout loads it
    counts = prepare_videos(samples, video_spec(cfg, family), cache, workers or default_workers(), progress=progress)
    return counts, cache
