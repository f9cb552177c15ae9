"""Video decoding through qwen-vl-utils (decord backend), the same path a real Qwen-VL pipeline uses.

Sampling (qwen-vl-utils `smart_nframes`): n = clamp(frames_in_window / video_fps * fps, min_frames, max_frames),
floored to an even number (two frames make one temporal patch), taken at `linspace(first, last, n)` frame indices.
Resizing (`smart_resize`): each frame keeps its aspect ratio, both sides become multiples of factor = 2 * patch
(28 for Qwen2.5-VL, 32 for Qwen3-VL), with min_pixels <= H*W <= min(max_pixels, 768 * factor^2,
total_pixels / n * 2). qwen-vl-utils' own defaults give at least 128 tokens per frame, which upscales small videos,
so `VideoSpec` always passes its bounds.

A file that cannot be used (missing, 0 bytes, unreadable, corrupt) raises `VideoError` whose message names the file
and the reason; the dataset turns it into a counted skip (or a `UserError` in strict mode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re

# Must be set before qwen_vl_utils is imported: it reads the variable once at import time.
os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")

import torch  # noqa: E402
from qwen_vl_utils import vision_process as _qwen_vision  # noqa: E402

if _qwen_vision.FORCE_QWENVL_VIDEO_READER is None:  # qwen_vl_utils was imported before us without the variable
    _qwen_vision.FORCE_QWENVL_VIDEO_READER = "decord"
    _qwen_vision.get_video_reader_backend.cache_clear()

PATCH_SIZE = {"qwen2_5_vl": 14, "qwen3_vl": 16}  # vision patch size; frames are multiples of 2 * patch
# Defaults in tokens (one token = factor^2 pixels after the 2x2 merge), so they suit both families.
MIN_TOKENS_PER_FRAME = 16
MAX_TOKENS_PER_FRAME = 256
TOTAL_TOKENS_PER_VIDEO = 8192


class VideoError(Exception):
    """A video file that cannot be used. The message is `PATH: reason`."""


@dataclasses.dataclass
class VideoSpec:
    """How frames are sampled and sized for the model."""

    fps: float = 2.0
    """Frames sampled per second of video (before min_frames / max_frames)."""
    min_frames: int = 4
    """Fewest frames sampled from a video (rounded up to even)."""
    max_frames: int = 64
    """Most frames sampled from a video (rounded down to even); long videos get a lower effective fps."""
    min_pixels: int | None = None
    """Smallest H*W of a frame; None = MIN_TOKENS_PER_FRAME * factor^2."""
    max_pixels: int | None = None
    """Largest H*W of a frame; None = MAX_TOKENS_PER_FRAME * factor^2."""
    total_pixels: int | None = None
    """Pixel budget of a whole video, shared by its frames; None = TOTAL_TOKENS_PER_VIDEO * factor^2."""
    image_patch_size: int = 14
    """Vision patch size of the model: 14 for Qwen2.5-VL, 16 for Qwen3-VL (see `for_family`)."""

    @classmethod
    def for_family(cls, family: str, **overrides) -> VideoSpec:
        if family not in PATCH_SIZE:
            raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(PATCH_SIZE)}")
        return cls(image_patch_size=PATCH_SIZE[family], **overrides)

    @property
    def factor(self) -> int:
        return 2 * self.image_patch_size

    def budget_problem(self, prefix: str = "") -> str | None:
        """Why frames cannot be sized under this spec (qwen-vl-utils would assert on every video), naming the keys
        (`prefix` + field) and the allowed range; None when it is fine."""
        f2 = self.factor ** 2
        lo = self.min_pixels or MIN_TOKENS_PER_FRAME * f2
        hi = self.max_pixels or MAX_TOKENS_PER_FRAME * f2
        if self.min_frames < 2 or self.max_frames < self.min_frames:
            return (f"{prefix}min_frames={self.min_frames}, {prefix}max_frames={self.max_frames}: need 2 <= min_frames "
                    "<= max_frames (two frames make one temporal patch)")
        for key, value in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels),
                           ("total_pixels", self.total_pixels)):
            if value is not None and value < f2:
                return (f"{prefix}{key}={value} is below one visual token per frame ({self.factor}x{self.factor} = "
                        f"{f2} pixels for this model); use >= {f2}")
        if hi < lo:
            which = f"{prefix}max_pixels={hi}" + ("" if self.max_pixels else " (the default)")
            return (f"{which} is below {prefix}min_pixels={lo}" + ("" if self.min_pixels else " (the default, "
                    f"{MIN_TOKENS_PER_FRAME} tokens of {f2} pixels)") + f": set {prefix}min_pixels <= "
                    f"{prefix}max_pixels, both >= {f2} (one token)")
        return None

    def element(self, path: str, clip_start: float | None = None, clip_end: float | None = None) -> dict:
        """The qwen-vl-utils message element (`{"type": "video", "video": path, ...}`) for this spec."""
        f2 = self.factor ** 2
        ele = {
            "type": "video", "video": str(path), "fps": float(self.fps),
            "min_frames": self.min_frames, "max_frames": self.max_frames,
            "min_pixels": self.min_pixels or MIN_TOKENS_PER_FRAME * f2,
            "max_pixels": self.max_pixels or MAX_TOKENS_PER_FRAME * f2,
            "total_pixels": self.total_pixels or TOTAL_TOKENS_PER_VIDEO * f2,
        }
        if clip_start is not None:
            ele["video_start"] = float(clip_start)
        if clip_end is not None:
            ele["video_end"] = float(clip_end)
        return ele


@dataclasses.dataclass
class DecodedVideo:
    """Frames of one video as qwen-vl-utils returns them, plus when they were taken."""

    frames: torch.Tensor
    """[T, C, H, W] float32 in 0..255, T even, H and W multiples of 2 * patch."""
    timestamps: list[float]
    """Seconds (from the start of the file) of each of the T frames."""
    sample_fps: float
    """Frames per second actually sampled (T / window length)."""
    metadata: dict
    """qwen-vl-utils metadata: fps, frames_indices, total_num_frames, video_backend (the processor's video_metadata)."""
    path: str
    duration: float
    """Seconds of the whole file."""


_DECORD_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # "[22:12:03] /src/video/x.cc:218: "


def _tidy(message: str, limit: int = 200) -> str:
    lines = message.strip().splitlines()
    return _DECORD_PREFIX.sub("", lines[0] if lines else "")[:limit]


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {_tidy(str(e))}"


def probe_video(path: str) -> tuple[int, float]:
    """(number of frames, average fps) from the container, without decoding; VideoError if unusable."""
    if not os.path.exists(path):
        raise VideoError(f"{path}: video file not found")
    if os.path.getsize(path) == 0:
        raise VideoError(f"{path}: video file is empty (0 bytes)")
    import decord

    # Errors are raised after the except block, so the VideoError does not carry decord's exception as its context:
    # that traceback keeps the reader alive, and a reader freed later by the garbage collector in a forked DataLoader
    # worker aborts it (see GroundingLoader).
    failed = None
    try:
        reader = decord.VideoReader(path, num_threads=1)
        n, fps = len(reader), float(reader.get_avg_fps())
        del reader
    except Exception as e:  # decord raises RuntimeError / DECORDError with C++ traces
        failed = _first_line(e)
    if failed is not None:
        raise VideoError(f"{path}: cannot open video ({failed})")
    if n <= 0:
        raise VideoError(f"{path}: video has no frames")
    if not fps > 0:
        raise VideoError(f"{path}: video has no frame rate")
    return n, fps


def read_duration(path: str) -> float:
    """Seconds of video in `path` (frames / average fps); VideoError if unusable."""
    n, fps = probe_video(path)
    return n / fps


@contextlib.contextmanager
def _backend_warnings():
    """Collect qwen-vl-utils warnings: when decord fails it logs why and retries with torchvision, whose failure
    (`torchvision.io.read_video` is gone in torchvision >= 0.24) would otherwise hide the real reason."""
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    _qwen_vision.logger.addHandler(handler)
    try:
        yield seen
    finally:
        _qwen_vision.logger.removeHandler(handler)


def load_video(path: str, spec: VideoSpec, clip_start: float | None = None,
               clip_end: float | None = None) -> DecodedVideo:
    """Decode the frames of `path` (optionally only the window clip_start..clip_end seconds) for the model.

    The file is first checked by `verify_video` (first, middle and last frame, one decoder thread): qwen-vl-utils'
    threaded decoding may conceal a damaged stream or not, depending on timing, and a bad file must be reported the
    same way every time (and the same way `mmpg check-data` reports it)."""
    duration = verify_video(path)
    failed = None
    with _backend_warnings() as warnings:
        try:
            frames, metadata = _qwen_vision.fetch_video(
                spec.element(path, clip_start, clip_end), image_patch_size=spec.image_patch_size,
                return_video_metadata=True)
        except Exception as e:  # raised below, without this context (see probe_video)
            failed = next((_tidy(w.split("msg:", 1)[-1]) for w in warnings if "msg:" in w), None) or _first_line(e)
    if failed is not None:
        raise VideoError(f"{path}: could not decode frames ({failed})")
    metadata = dict(metadata)
    metadata["frames_indices"] = [int(i) for i in metadata["frames_indices"]]
    timestamps = [i / metadata["fps"] for i in metadata["frames_indices"]]
    window = metadata["total_num_frames"] / metadata["fps"]  # seconds covered by the sampled window
    return DecodedVideo(frames=frames, timestamps=timestamps, sample_fps=len(timestamps) / window,
                        metadata=metadata, path=str(path), duration=duration)


def verify_video(path: str) -> float:
    """Open `path` and decode its first, middle and last frames; return its duration in seconds.

    Cheaper than decoding everything, and catches files that open but are truncated or damaged near those frames.
    Raises VideoError (`PATH: reason`)."""
    n, fps = probe_video(path)
    import decord

    failed = None
    try:
        decord.VideoReader(path, num_threads=1).get_batch(sorted({0, n // 2, n - 1})).asnumpy()
    except Exception as e:  # raised below, without this context (see probe_video)
        failed = _first_line(e)
    if failed is not None:
        raise VideoError(f"{path}: could not decode frames ({failed})")
    return n / fps
