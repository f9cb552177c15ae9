"""Whether the DataLoader workers decode videos as fast as the GPUs train on them, and how many workers that takes
(`mmpg plan --decode`, `mmpg plan --decode-fps N`): the data side of a step, beside the step time the plan estimates.

The figure is how many frames of the source video one core loads per second through mmpg's loader
(`mmpg.data.video.load_video`: decord on one thread, then qwen-vl-utils' sampling and resizing), at the config's
video settings: either the user's own (`--decode-fps N`, timed on their footage) or a probe of this machine
(`mmpg.plan.decode_probe`, a few seconds): two generated H.264 clips (640x360 and 1280x720, 30 fps; a panning
texture with per-pixel noise standing in for detail and sensor noise, x264 superfast crf 23, a keyframe every
KEYFRAME_FRAMES frames, x264's default) decoded on one core. The probe measures two rates at each size, and a
typical video's load is modelled from them (the source at `--footage WxH@FPS`, default 1280x720@30):

    decode     seconds per source frame decoded (decord, one thread, no colour conversion)
    sample     seconds per sampled frame: colour conversion at the source size and the resize to the config's frame
               size for that video (qwen-vl-utils' sizing), from a load that samples every frame of the clip
    per video  n = qwen-vl-utils' frame count for the window (data.fps, data.min_frames, data.max_frames);
               decoded = n * min(gap, K / 2) + min(K, F) frames, gap = F / n source frames between samples, F the
               window's frames, K the keyframe interval: frames between samples are decoded (decord skips forward),
               a sample past a keyframe seeks to it (K / 2 on average), and the file check decodes the middle and
               last frames from their keyframes (`verify_video`);
               seconds = decoded * decode + n * sample, each rate linear in the source's pixels through the two
               probed sizes
    figure     F / seconds: frames of video loaded per second, the unit of --decode-fps

Generated video is not footage: a camera's detail, motion and encoder settings decode at their own speed (per-pixel
noise alone slowed 640x360 4.4x, docs/data.md), so the probe is a stated stand-in and `--decode-fps` the better
figure. Per step: a data-parallel rank loads its data.batch_size / (GPUs / sp) prompts as videos of up to
data.queries_per_video queries each (the dataset's own runs when data.train is readable, each video decoded once
per batch: `mmpg.data.dataset`), every rank of a sequence-parallel group decoding its group's videos whole; its
data.num_workers workers, each a process on one core, decode side by side while the step runs. The typical video is
`--video-minutes` long when given, else the mean window of data.train's videos when the file is readable here, else
the plan's own video (long enough to reach data.max_frames, as the plan's token count assumes).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from mmpg.errors import UserError
from mmpg.plan.decode_probe import KEYFRAME_FRAMES

SOURCE = (1280, 720, 30.0)  # the footage assumed without --footage: width, height, frames per second
HEADER_READS = 64  # video files opened for their durations when the annotations lack them (a sample of them)
NODE_GPUS = 8  # GPUs of a node, for the cores a node needs (fewer when the run has fewer)


def samples_from_features() -> bool:
    """Whether this transformers' Qwen-VL forward takes precomputed vision features (mm_encoder_outputs, >= 5.18),
    which GRPO's sampling from the sequence-parallel group's features needs (`mmpg.rl.trainer.sequence_part`)."""
    import inspect

    from transformers import Qwen2_5_VLForConditionalGeneration

    return "mm_encoder_outputs" in inspect.signature(Qwen2_5_VLForConditionalGeneration.forward).parameters


def rank_share(job: str, sp: int) -> float:
    """The part of each video one rank of a sequence-parallel group decodes: only its own frames (1/sp,
    `mmpg.data.dataset.GroundingDataset(part=)`), but for GRPO on a transformers whose forward takes no precomputed
    features, where each rank decodes its videos whole to sample from them (`mmpg.rl.trainer.sequence_part`)."""
    return 1 / sp if job == "sft" or samples_from_features() else 1.0


@dataclasses.dataclass(frozen=True)
class Footage:
    """The typical video a step decodes: its window in seconds, frame size and rate, and where the length came
    from; `runs`: mean queries a video is decoded for at once (None: data.queries_per_video, the most)."""

    seconds: float
    width: int
    height: int
    fps: float
    why: str
    runs: float | None = None
    samples: int = 0  # training samples read from data.train (0: the file was not read)

    @property
    def frames(self) -> float:
        return self.seconds * self.fps


def parse_footage(text: str | None) -> tuple[int, int, float]:
    """`WxH` or `WxH@FPS` -> (width, height, fps); SOURCE without it."""
    if not text:
        return SOURCE
    m = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+(?:\.\d+)?))?", text.strip())
    if not m or int(m[1]) < 16 or int(m[2]) < 16 or (m[3] is not None and not float(m[3]) > 0):
        raise UserError(f"--footage {text}: give the source video's frame size and rate as WxH@FPS, e.g. "
                        "1280x720@30 or 1920x1080@25 (sides >= 16)")
    return int(m[1]), int(m[2]), float(m[3]) if m[3] else SOURCE[2]


def sampled_frames(frames: float, source_fps: float, fps: float, min_frames: int, max_frames: int) -> int:
    """Frames qwen-vl-utils samples from a window of `frames` source frames (its `smart_nframes`)."""
    lo = 2 * math.ceil(min_frames / 2)
    hi = 2 * math.floor(min(max_frames, frames) / 2)
    n = min(max(frames / source_fps * fps, lo), hi, frames)
    return max(2, 2 * math.floor(n / 2))


def decoded_frames(frames: float, n: int) -> float:
    """Source frames decord decodes to load n samples of a `frames`-frame window, the file check included."""
    gap = frames / n
    return n * min(gap, KEYFRAME_FRAMES / 2) + min(KEYFRAME_FRAMES, frames)


def typical_video(cfg, minutes: float | None, footage: str | None) -> Footage:
    """The video a step decodes: data.train's mean window when it can be read here, else --video-minutes, else the
    plan's video (data.max_frames / data.fps)."""
    w, h, fps = parse_footage(footage)
    d = cfg.data
    if minutes is not None:
        if not minutes > 0:
            raise UserError(f"--video-minutes {minutes}: give the typical video's length in minutes, > 0")
        return Footage(minutes * 60, w, h, fps, "yours (--video-minutes)")
    read = dataset_videos(cfg) if d.train and Path(d.train).is_file() else None
    if read:
        seconds, runs, samples, videos = read
        return Footage(seconds, w, h, fps, f"the mean window of data.train's {videos:,} videos ({samples:,} "
                       "samples)", runs, samples)
    why = "the plan's, long enough to reach data.max_frames at data.fps"
    if d.train:
        why += f" (data.train {d.train} is not readable here)"
    return Footage(d.max_frames / d.fps, w, h, fps, why + "; --video-minutes M and --footage WxH@FPS for yours")


def dataset_videos(cfg) -> tuple[float, float, int, int] | None:
    """(mean window seconds over the runs a step decodes, mean queries per run, samples, distinct videos) of
    data.train, durations from the annotations (or the files' headers where they are missing and present); None
    when no duration is known."""
    from mmpg.data.dataset import video_key
    from mmpg.data.formats import load_annotations

    d = cfg.data
    try:
        samples = load_annotations(d.train, d.videos or None, d.format, strict=False, log_skips=False).samples
    except (UserError, OSError):
        return None
    samples = samples[:d.max_samples] if d.max_samples > 0 else samples
    by_video: dict = {}
    for s in samples:
        by_video.setdefault(video_key(s), []).append(s)
    reads = [HEADER_READS]  # files opened for a duration the annotations lack, at most HEADER_READS
    windows = {key: _window(group[0], _duration(group, reads)) for key, group in by_video.items()}
    known = {k: v for k, v in windows.items() if v}
    if not known:
        return None
    q = max(1, d.queries_per_video)
    runs = [(key, math.ceil(len(group) / q)) for key, group in by_video.items() if key in known]
    count = sum(r for _, r in runs)
    mean = sum(known[key] * r for key, r in runs) / count
    queries = sum(len(by_video[key]) for key, _ in runs) / count
    return mean, queries, len(samples), len(known)


def _duration(group, reads: list[int]) -> float | None:
    known = [s.duration for s in group if s.duration]
    if known:
        return known[0]
    if reads[0] > 0 and Path(group[0].video).is_file():
        reads[0] -= 1
        from mmpg.data.video import VideoError, read_duration

        try:
            return read_duration(group[0].video)
        except VideoError:
            return None
    return None


def _window(sample, duration: float | None) -> float | None:
    if duration is None:
        return None
    start = sample.clip_start or 0.0
    end = sample.clip_end if sample.clip_end is not None else duration
    return max(0.0, min(end, duration) - start) or None


def per_pixels(rows: list[dict], key: str, pixels: int) -> float:
    """rows' `key` (seconds per frame) at a frame of `pixels`: linear through the smallest and largest probed sizes
    (slope >= 0), proportional to the pixels with one size."""
    pts = sorted((r["width"] * r["height"], r[key]) for r in rows)
    (p0, v0), (p1, v1) = pts[0], pts[-1]
    if p1 == p0:
        return v0 * pixels / p0
    slope = max((v1 - v0) / (p1 - p0), 0.0)
    return max(v0 + slope * (pixels - p0), 0.0)


def video_seconds(foot: Footage, n: int, probed: dict) -> float:
    """One core's seconds to load the typical video from the probe's rates (the module docstring's model)."""
    pixels = foot.width * foot.height
    return (decoded_frames(foot.frames, n) * per_pixels(probed["sizes"], "decode_s", pixels)
            + n * per_pixels(probed["sizes"], "sample_s", pixels))


def decode_plan(cfg, plan: dict, foot: Footage, decode_fps: float | None = None, probed: dict | None = None) -> dict:
    """The decode side of `plan` (`mmpg.plan.whole.plan`'s dict): per data-parallel rank and step, from the user's
    figure (`decode_fps`, frames of video loaded per second on one core) or the probe's rates (`probed`)."""
    d = cfg.data
    if decode_fps is not None and not decode_fps > 0:
        raise UserError(f"--decode-fps {decode_fps}: give frames of video one core loads per second, > 0")
    gpus, sp = plan["devices"], plan["sp"]
    share = rank_share(plan.get("job", "train"), sp)
    prompts = d.batch_size / (gpus // sp)
    per_video = min(foot.runs or max(1, d.queries_per_video), prompts)
    videos = prompts / per_video
    n = sampled_frames(foot.frames, foot.fps, d.fps, d.min_frames, d.max_frames)
    seconds = foot.frames / decode_fps if decode_fps else video_seconds(foot, n, probed)
    work = videos * seconds * share  # one core's seconds of decoding a step, on each rank
    step = plan["step_seconds"]["total"]
    workers = d.num_workers
    needed = max(1, math.ceil(work / step))
    node = min(gpus, NODE_GPUS)
    out = {"source": "--decode-fps" if decode_fps else "probe", "video_fps_per_core": foot.frames / seconds,
           "probe": probed, "video_seconds": foot.seconds, "video_from": foot.why,
           "footage": {"width": foot.width, "height": foot.height, "fps": foot.fps},
           "sampled_frames": n, "decoded_frames": None if decode_fps else decoded_frames(foot.frames, n),
           "seconds_per_video": seconds, "prompts_per_rank": prompts, "queries_per_video": per_video,
           "videos_per_step": videos, "sp": sp, "rank_share": share, "core_seconds_per_step": work, "workers": workers,
           "seconds_per_step": work / max(workers, 1), "step_seconds": step,
           "keeps_up": workers > 0 and work / workers <= step, "workers_needed": needed,
           "node_gpus": node, "cores_per_node": needed * node, "frame_cache": bool(d.frame_cache),
           "epochs": None}
    if foot.samples:
        out["epochs"] = cfg.trainer.total_steps * d.batch_size / foot.samples
    return out


def _n(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def render(dp: dict | None) -> list[str]:
    """The plan's decode lines (one line saying how to get them when `dp` is None)."""
    if dp is None:
        return ["video decoding: not estimated (--decode probes this machine's decoding in a few seconds; "
                "--decode-fps N takes your own figure: docs/plan.md)"]
    f = dp["footage"]
    decoded = f", {_n(dp['decoded_frames'])} decoded" if dp["decoded_frames"] is not None else ""
    q = dp["queries_per_video"]
    whole = ""
    if dp["sp"] > 1:
        whole = f", each of the {dp['sp']} ranks of its sequence-parallel group decoding them whole" \
            if dp["rank_share"] == 1 else f", each rank of its sequence-parallel group decoding its 1/{dp['sp']}"
    lines = [f"video decoding per rank (ESTIMATE): {_n(dp['videos_per_step'])} videos a step "
             f"({_n(dp['prompts_per_rank'])} prompts, {_n(q)} quer{'y' if q == 1 else 'ies'} a video{whole}), "
             f"{dp['seconds_per_video']:.1f} s each on one core: {dp['video_seconds'] / 60:.1f} min of "
             f"{f['width']}x{f['height']} at {f['fps']:g} fps, {dp['sampled_frames']} frames sampled{decoded}",
             f"  the video: {dp['video_from']}"]
    w, step = dp["workers"], dp["step_seconds"]
    k = dp["workers_needed"]
    need = (f"{k} worker{'s' if k > 1 else ''} a rank keep{'' if k > 1 else 's'} up: {dp['cores_per_node']} cores a "
            f"node of {dp['node_gpus']} GPUs")
    if w == 0:
        lines.append(f"  data.num_workers 0: {dp['core_seconds_per_step']:.1f} s of decoding in the training process "
                     f"each step, beside the {step:.2f} s step ({need})")
    else:
        verdict = "keeps up" if dp["keeps_up"] else "DOES NOT KEEP UP: the GPUs wait"
        lines.append(f"  data.num_workers {w}: {dp['seconds_per_step']:.1f} s of decoding a step against the "
                     f"{step:.2f} s step: {verdict} ({need})")
    lines.append("  " + figure_line(dp))
    lines += ["  " + note for note in cache_notes(dp)]
    return lines


def figure_line(dp: dict) -> str:
    fps = f"{_n(dp['video_fps_per_core'])} video frames/s a core"
    if dp["source"] == "--decode-fps":
        return f"figure: {fps}, yours (--decode-fps)"
    p = dp["probe"]
    sizes = ", ".join(f"{r['width']}x{r['height']} {_n(1 / r['decode_s'])} frames/s decoded + "
                      f"{r['sample_s'] * 1e3:.1f} ms a sampled frame" for r in p["sizes"])
    return (f"figure: {fps}, from a probe of this machine on {p['date']} ({p['seconds']:.1f} s, one core: "
            f"generated H.264, {sizes}); real footage decodes at its own speed: time load_video on yours and give "
            "--decode-fps N")


def cache_notes(dp: dict) -> list[str]:
    epochs = dp["epochs"]
    if dp["frame_cache"]:
        out = ["data.frame_cache is set: the first epoch decodes as above (none of it when `mmpg prepare-videos` "
               "filled the cache first), later epochs read the frames (>= 12x faster than decoding: docs/data.md)"]
        if epochs is not None and epochs <= 1:
            out.append(f"this run trains {epochs:.2f} epochs of data.train: only `mmpg prepare-videos` saves "
                       "decoding")
        return out
    if dp["keeps_up"]:
        return []
    return ["data.frame_cache=DIR, filled by `mmpg prepare-videos`, takes decoding off the steps (docs/data.md)"]


def estimate(cfg, plan: dict, decode: bool, decode_fps: float | None, minutes: float | None,
             footage: str | None) -> dict | None:
    """`decode_plan` for `mmpg plan`'s flags: the probe with --decode, the user's figure with --decode-fps, None
    when neither was asked for (the plan stays arithmetic: the probe measures the machine `mmpg plan` runs on, takes
    seconds and varies from run to run)."""
    if not decode and decode_fps is None:
        if minutes is not None or footage:
            raise UserError("--video-minutes and --footage shape the decode estimate: give --decode (probe this "
                            "machine) or --decode-fps N (your figure) with them")
        return None
    foot = typical_video(cfg, minutes, footage)
    probed = None
    if decode:
        from mmpg.data.video import VideoSpec
        from mmpg.plan.decode_probe import probe
        from mmpg.plan.recipe import geometry_of

        d = cfg.data
        spec = VideoSpec(image_patch_size=geometry_of(cfg.model.path).vision.patch, **d.video_values())
        probed = probe(spec, sampled_frames(foot.frames, foot.fps, d.fps, d.min_frames, d.max_frames))
    return decode_plan(cfg, plan, foot, decode_fps, probed)
