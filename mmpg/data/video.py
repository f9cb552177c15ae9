"""Video decoding as qwen-vl-utils (decord backend) does it, the path a real Qwen-VL pipeline uses: its own sampling
and sizing helpers, decord, torchvision's resize; the frames equal its `fetch_video`'s bit for bit
(tests/test_video_parts.py), resized 32 frames at a time instead of all at once (its peak: ~14 GB for 768 frames of
720p).

Sampling (qwen-vl-utils `smart_nframes`): n = clamp(frames_in_window / video_fps * fps, min_frames, max_frames),
floored to an even number (two frames make one temporal patch), taken at `linspace(first, last, n)` frame indices.
Resizing (`smart_resize`): each frame keeps its aspect ratio, both sides become multiples of factor = 2 * patch
(28 for Qwen2.5-VL, 32 for Qwen3-VL), with min_pixels <= H*W <= min(max_pixels, 768 * factor^2,
total_pixels / n * 2). qwen-vl-utils' own defaults give at least 128 tokens per frame, which upscales small videos,
so `VideoSpec` always passes its bounds.

Under sequence parallelism rank r of sp encodes only temporal patch groups [t r / sp, t (r + 1) / sp) of a video's
t = T / 2 groups; `load_video_part` decodes just those frames (sampling indices and frame size still the whole
video's, so the part is the slice of `load_video`'s frames bit for bit) and keeps the whole video's timestamps and
metadata for the prompt. Decoding cost follows the frames decoded, so a rank's share of the work is about 1/sp.

A file that cannot be used (missing, 0 bytes, unreadable, corrupt) raises `VideoError` whose message names the file
and the reason; the dataset turns it into a counted skip (or a `UserError` in strict mode).
"""

from __future__ import annotations

import dataclasses
import os
import re

# Must be set before qwen_vl_utils is imported: it reads the variable once at import time.
os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")

import torch  # noqa: E402
from qwen_vl_utils import vision_process as _qwen_vision  # noqa: E402

from mmpg.grouping.inputs import part_span  # noqa: E402

if _qwen_vision.FORCE_QWENVL_VIDEO_READER is None:  # qwen_vl_utils was imported before us without the variable
    _qwen_vision.FORCE_QWENVL_VIDEO_READER = "decord"
    _qwen_vision.get_video_reader_backend.cache_clear()

PATCH_SIZE = {"qwen2_5_vl": 14, "qwen3_vl": 16}  # vision patch size; frames are multiples of 2 * patch
# Defaults in tokens (one token = factor^2 pixels after the 2x2 merge), so they suit both families.
MIN_TOKENS_PER_FRAME = 16
MAX_TOKENS_PER_FRAME = 256
TOTAL_TOKENS_PER_VIDEO = 8192
# Frames `load_video_part` resizes at a time. qwen-vl-utils resizes all of a video's at once, in float32 at the
# file's size: 768 frames of 1280x720 hold ~8.5 GB at that moment (~14 GB at the peak), where 32 hold ~0.35 GB.
CHUNK_FRAMES = 32


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

    def part(self, rank: int, sp: int) -> VideoPart:
        """Rank `rank`'s part of these frames under sequence parallelism of size `sp` (see `load_video_part`)."""
        a, b = part_groups(self.frames.shape[0] // 2, rank, sp)
        return VideoPart(frames=self.frames[2 * a: 2 * b], first_frame=2 * a, whole_frames=self.frames.shape[0],
                         rank=rank, sp=sp, timestamps=self.timestamps, sample_fps=self.sample_fps,
                         metadata=self.metadata, path=self.path, duration=self.duration)


@dataclasses.dataclass
class VideoPart:
    """One sequence-parallel rank's frames of a video: those of the temporal patch groups [a, b) it encodes, frames
    2a..2b of the whole decode; the timestamps and metadata are the whole video's (the prompt is built from them)."""

    frames: torch.Tensor
    """[2 (b - a), C, H, W] float32 in 0..255, equal to the whole decode's frames[2a:2b]; H, W are the whole's."""
    first_frame: int
    """2a: where these frames start in the whole decode."""
    whole_frames: int
    """T, the whole decode's frame count."""
    rank: int
    sp: int
    timestamps: list[float]
    """Seconds of each of the whole video's T frames."""
    sample_fps: float
    metadata: dict
    """The whole video's qwen-vl-utils metadata (frames_indices of all T frames)."""
    path: str
    duration: float

    @property
    def groups(self) -> tuple[int, int]:
        """The temporal patch groups [a, b) these frames make."""
        return self.first_frame // 2, (self.first_frame + self.frames.shape[0]) // 2

    def as_video(self) -> DecodedVideo:
        """The whole video's `DecodedVideo`, for a part that holds every frame (sp 1); ValueError otherwise."""
        if self.frames.shape[0] != self.whole_frames:
            raise ValueError(f"{self.path}: rank {self.rank} of sp {self.sp} holds frames {self.first_frame}.."
                             f"{self.first_frame + self.frames.shape[0]} of {self.whole_frames}, not the whole video")
        return DecodedVideo(frames=self.frames, timestamps=self.timestamps, sample_fps=self.sample_fps,
                            metadata=self.metadata, path=self.path, duration=self.duration)


def part_groups(groups: int, rank: int, sp: int) -> tuple[int, int]:
    """Temporal patch groups [a, b) of a `groups`-group video that rank `rank` of `sp` encodes: the vision tower's
    split under sequence parallelism (`mmpg.grouping.sequence.frame_ranges`)."""
    if sp < 1 or not 0 <= rank < sp:
        raise ValueError(f"rank {rank} of sp {sp}: need sp >= 1 and 0 <= rank < sp")
    return part_span(groups, rank, sp)


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


def load_video(path: str, spec: VideoSpec, clip_start: float | None = None,
               clip_end: float | None = None) -> DecodedVideo:
    """Decode the frames of `path` (optionally only the window clip_start..clip_end seconds) for the model.

    The file is first checked by `verify_video` (first, middle and last frame, one decoder thread): qwen-vl-utils'
    threaded decoding may conceal a damaged stream or not, depending on timing, and a bad file must be reported the
    same way every time (and the same way `mmpg check-data` reports it)."""
    # qwen-vl-utils' own path (fetch_video) resizes every frame at once in float32 at the file's size (~14 GB at the
    # peak for 768 frames of 720p); the whole video as rank 0 of 1 is the same frames bit for bit, 32 at a time
    return load_video_part(path, spec, clip_start, clip_end, rank=0, sp=1).as_video()


def load_video_part(path: str, spec: VideoSpec, clip_start: float | None = None, clip_end: float | None = None, *,
                    rank: int, sp: int) -> VideoPart:
    """Rank `rank` of `sp`'s part of `load_video(path, spec, clip_start, clip_end)`, decoding only its frames.

    The sampling indices and the frame size are the whole video's, computed by qwen-vl-utils' own helpers as its
    decord reader and `fetch_video` compute them (`_sampled_indices`, `_frame_size`: the size depends on the whole
    video's frame count through total_pixels / T * 2); decord then decodes only indices[2a:2b] and they are resized
    as fetch_video resizes, CHUNK_FRAMES at a time (torchvision's resize works frame by frame, so a part is the slice
    of the whole: bit for bit, tests/test_video_parts.py). At sp 1 the part is the whole video, equal to
    `load_video`'s at a fraction of its memory (`as_video`). The file is checked and errors are raised as by
    `load_video` (VideoError `PATH: reason`); a rank or sp out of range is a ValueError."""
    part_groups(0, rank, sp)  # the arguments checked before any work
    duration = verify_video(path)
    ele = spec.element(path, clip_start, clip_end)
    failed = None
    try:
        frames, first, metadata = _decode_part(ele, spec.image_patch_size, rank, sp)
    except Exception as e:  # raised below, without this context (see probe_video)
        failed = _tidy(str(e)) or _first_line(e)
    if failed is not None:
        raise VideoError(f"{path}: could not decode frames ({failed})")
    timestamps = [i / metadata["fps"] for i in metadata["frames_indices"]]
    window = metadata["total_num_frames"] / metadata["fps"]
    return VideoPart(frames=frames, first_frame=first, whole_frames=len(timestamps), rank=rank, sp=sp,
                     timestamps=timestamps, sample_fps=len(timestamps) / window, metadata=metadata, path=str(path),
                     duration=duration)


def _decode_part(ele: dict, patch: int, rank: int, sp: int) -> tuple[torch.Tensor, int, dict]:
    """(frames [2 (b - a), C, H, W] float32, 2a, the whole video's metadata) of one rank's part.

    The frames are decoded CHUNK_FRAMES at a time into one uint8 tensor at the file's size, the reader is closed,
    and then they are resized CHUNK_FRAMES at a time (frame by frame, the same values as all at once): a decord reader
    left open keeps decoding ahead on its own thread, which would cost a rank whose part ends before the video does
    a whole core while it resizes."""
    import decord

    reader = decord.VideoReader(ele["video"])  # opened as qwen-vl-utils opens it (decoder threads: ffmpeg's choice)
    fps = reader.get_avg_fps()
    indices, window = _sampled_indices(ele, len(reader), fps)
    a, b = part_groups(len(indices) // 2, rank, sp)
    mine = indices[2 * a: 2 * b] or indices[:1]  # an empty part decodes one frame all the same: the frame size
    raw = None  # [n, H0, W0, C] uint8
    for start in range(0, len(mine), CHUNK_FRAMES):
        chunk = torch.from_numpy(reader.get_batch(mine[start:start + CHUNK_FRAMES]).asnumpy())
        if raw is None:
            raw = torch.empty(len(mine), *chunk.shape[1:], dtype=chunk.dtype)
        raw[start:start + len(chunk)] = chunk
    del reader, chunk
    size = _frame_size(ele, patch, len(indices), raw.shape[1], raw.shape[2])
    frames = torch.empty(len(mine), raw.shape[3], *size)
    for start in range(0, len(mine), CHUNK_FRAMES):
        frames[start:start + CHUNK_FRAMES] = _qwen_vision.transforms.functional.resize(
            raw[start:start + CHUNK_FRAMES].permute(0, 3, 1, 2), list(size),
            interpolation=_qwen_vision.InterpolationMode.BICUBIC, antialias=True).float()
    metadata = {"fps": fps, "frames_indices": indices, "total_num_frames": window, "video_backend": "decord"}
    return frames[: 2 * (b - a)], 2 * a, metadata


def sampled_indices(spec: VideoSpec, path: str, total_frames: int, fps: float, clip_start: float | None = None,
                    clip_end: float | None = None) -> list[int]:
    """The frame indices `load_video` decodes from a video of `total_frames` frames at `fps` under `spec`, without
    opening it (what the toy world places its events around)."""
    return _sampled_indices(spec.element(path, clip_start, clip_end), total_frames, fps)[0]


def _sampled_indices(ele: dict, total_frames: int, fps: float) -> tuple[list[int], int]:
    """(frame indices of the T sampled frames, frames in the window): qwen-vl-utils' decord reader's sampling,
    linspace(first, last, smart_nframes) rounded."""
    first, last, window = _qwen_vision.calculate_video_frame_range(ele, total_frames, fps)
    n = _qwen_vision.smart_nframes(ele, total_frames=window, video_fps=fps)
    return torch.linspace(first, last, n).round().long().tolist(), window


def _frame_size(ele: dict, patch: int, nframes: int, height: int, width: int) -> tuple[int, int]:
    """(H, W) that qwen-vl-utils' fetch_video resizes `nframes` frames of height x width to: smart_resize between
    min_pixels and max_pixels, the latter capped by the video's budget total_pixels / nframes * 2."""
    q = _qwen_vision
    factor = patch * q.SPATIAL_MERGE_SIZE
    min_pixels = ele.get("min_pixels", q.VIDEO_MIN_TOKEN_NUM * factor * factor)
    total_pixels = ele.get("total_pixels", q.MODEL_SEQ_LEN * factor * factor * 0.9)
    max_pixels = max(min(q.VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / nframes * q.FRAME_FACTOR),
                     int(min_pixels * 1.05))
    max_pixels = min(ele.get("max_pixels", max_pixels), max_pixels)
    return q.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


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
