"""The decode probe of `mmpg plan --decode`: two short generated H.264 clips decoded on one core of this machine,
giving the two rates `mmpg.plan.decode` models a video's load from (its docstring states the model).

A clip is a panning multi-scale texture with per-pixel noise (PROBE_NOISE luma levels, drawn from a bank of three
frames), written by PyAV's libx264 (superfast, crf 23, High profile with CABAC and B-frames, keyframes at x264's
default interval, one thread): ~3 Mbit/s at 1280x720, as web footage of that size. It is timed per size on one core
(the calling thread pinned to one CPU, torch on one thread: what one DataLoader worker gets when the workers are as
many as the cores they run on), in CPU seconds of the process, so that other programs sharing the core do not count:

    decode  a decord reader on one thread skipping every frame (decoded, no colour conversion); the best of two
    load    `mmpg.data.video.load_video` at a spec that samples every frame, sized as the config sizes the typical
            video's frames; (load - 2 x decode) / frames is the per-sample cost (the file check decodes the clip
            once more)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import time
from fractions import Fraction
from pathlib import Path

KEYFRAME_FRAMES = 250  # x264's and ffmpeg's default keyframe interval (keyint)
PROBE_SIZES = ((640, 360), (1280, 720))
PROBE_FRAMES = 30  # one second of each size: encoding it is most of the probe's time
PROBE_NOISE = 8  # per-pixel noise, luma levels 0..N: ~3 Mbit/s at 1280x720, as web footage of that size
PROBE_BUDGET_S = 6.0  # the probe's whole time on one core, imports aside: 2.0-2.1 s measured (docs/plan.md)


def write_clip(path: str | Path, width: int, height: int, frames: int, fps: float = 30.0, seed: int = 0) -> None:
    """A `frames`-frame H.264 clip of a panning textured scene with per-pixel noise (see the module docstring)."""
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    h, w = height + 2 * frames, width + 4 * frames  # room to pan 2 px down and 4 px right a frame
    texture = np.zeros((h, w), np.float32)
    for scale in (4, 16, 64):
        cells = rng.standard_normal((h // scale + 1, w // scale + 1)).astype(np.float32) * scale ** 0.5
        texture += np.repeat(np.repeat(cells, scale, 0), scale, 1)[:h, :w]
    texture = ((texture - texture.min()) / (np.ptp(texture) or 1.0) * 170 + 30).astype(np.uint8)
    noise = rng.integers(0, PROBE_NOISE + 1, (3, height, width), dtype=np.uint8)
    u, v = np.full((height // 2, width // 2), 118, np.uint8), np.full((height // 2, width // 2), 138, np.uint8)
    rate = Fraction(fps).limit_denominator(1001)
    options = {"preset": "superfast", "crf": "23", "threads": "1", "keyint": str(KEYFRAME_FRAMES)}
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=rate, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            y = texture[2 * i: 2 * i + height, 4 * i: 4 * i + width] + noise[i % 3]
            plane = np.concatenate([y.reshape(-1), u.reshape(-1), v.reshape(-1)]).reshape(-1, width)
            frame = av.VideoFrame.from_ndarray(plane, format="yuv420p")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


@contextlib.contextmanager
def one_core():
    """The calling thread on one CPU (threads it starts inherit it: decord's, ffmpeg's) and torch on one thread."""
    import torch

    threads = torch.get_num_threads()
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    torch.set_num_threads(1)
    if mask:
        os.sched_setaffinity(0, {min(mask)})
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if mask:
            os.sched_setaffinity(0, mask)


def frame_pixels(spec, n: int) -> int:
    """The most pixels qwen-vl-utils lets a frame of an n-frame video have under `spec` (its `fetch_video`)."""
    from qwen_vl_utils import vision_process as qwen

    ele = spec.element("probe")
    cap = min(qwen.VIDEO_MAX_TOKEN_NUM * spec.factor ** 2, ele["total_pixels"] / n * 2)
    return int(min(ele["max_pixels"], max(cap, int(ele["min_pixels"] * 1.05))))


def _decode_seconds(path: str, frames: int) -> float:
    import decord

    t0 = time.process_time()
    reader = decord.VideoReader(path, num_threads=1)
    reader.skip_frames(frames)
    del reader
    return time.process_time() - t0


def probe(spec, n: int, sizes=PROBE_SIZES, frames: int = PROBE_FRAMES, fps: float = 30.0) -> dict:
    """{"sizes": [{"width", "height", "decode_s" (per source frame), "sample_s" (per sampled frame)}, ...],
    "frames", "fps", "frame_pixels" (the sampled frames' cap), "seconds" (the probe's own time), "date"} on one core;
    `spec`: the config's `VideoSpec`, `n`: the typical video's sampled frames (which size its frames)."""
    from mmpg.data.video import VideoSpec, load_video

    started = time.perf_counter()
    cap = frame_pixels(spec, n)
    dense = VideoSpec(fps=fps, min_frames=2, max_frames=frames, min_pixels=min(spec.element("p")["min_pixels"], cap),
                      max_pixels=cap, total_pixels=cap * frames, image_patch_size=spec.image_patch_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmpg-decode-probe-") as tmp, one_core():
        for width, height in sizes:
            path = str(Path(tmp) / f"{width}x{height}.mp4")
            write_clip(path, width, height, frames, fps)
            decode = min(_decode_seconds(path, frames) for _ in range(2))
            t0 = time.process_time()
            load_video(path, dense)
            load = time.process_time() - t0
            rows.append({"width": width, "height": height, "decode_s": decode / frames,
                         "sample_s": max(load - 2 * decode, 0.0) / frames, "bytes": os.path.getsize(path)})
    return {"sizes": rows, "frames": frames, "fps": fps, "frame_pixels": cap,
            "seconds": time.perf_counter() - started, "date": datetime.date.today().isoformat()}
