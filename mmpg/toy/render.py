"""Drawing and encoding for the synthetic grounding videos (see `mmpg.toy.videos` for the dataset).

We paint straight into YUV 4:2:0 planes instead of RGB: converting each RGB frame with swscale cost
~2 ms a frame, more than x264 itself, while a flat background converted once plus a few painted
masks per frame costs almost nothing. Colours go through BT.601 limited range (what decoders assume
for untagged SD video, and what we tag the stream with), so a decoded pixel of a painted object
comes back within a few levels of its RGB value away from the edges.

Chroma is half resolution, so each shape is painted twice: on the luma plane with full-resolution
pixel centres and on the chroma planes with the centres of 2x2 blocks. Object edges therefore blend
with the background after decoding; tests count pixels well inside the colour tolerance, not edges.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import av
import numpy as np

# Saturated colours, far (> 60 per channel in at least one channel) from every background we draw.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 190, 40),
    "blue": (40, 70, 230),
    "yellow": (235, 215, 30),
    "magenta": (210, 40, 200),
    "cyan": (30, 200, 210),
    "orange": (245, 130, 20),
    "white": (245, 245, 245),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
# Smallest per-channel distance (max over channels) between any background pixel and any palette
# colour; tests detect objects with a per-channel tolerance of ~40, so 60 leaves room for H.264 error.
BACKGROUND_MIN_DISTANCE = 60

# BT.601 limited range, rows: Y, U (Cb), V (Cr); offsets added after the matrix product.
_RGB_TO_YUV = np.array(
    [[0.257, 0.504, 0.098], [-0.148, -0.291, 0.439], [0.439, -0.368, -0.071]], dtype=np.float64
)
_YUV_OFFSET = np.array([16.0, 128.0, 128.0])


class Sprite(NamedTuple):
    """One object to paint on one frame: centre and size in luma pixels, colour as (Y, U, V)."""

    shape: str
    cx: float
    cy: float
    size: float
    yuv: tuple[int, int, int]


def rgb_to_yuv(rgb: np.ndarray) -> np.ndarray:
    """[..., 3] RGB (0..255) -> [..., 3] float YUV, BT.601 limited range."""
    return np.asarray(rgb, dtype=np.float64) @ _RGB_TO_YUV.T + _YUV_OFFSET


def colour_yuv(rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """Integer YUV for a palette colour, so every frame paints exactly the same code values."""
    y, u, v = np.clip(np.rint(rgb_to_yuv(np.array(rgb))), 0, 255).astype(int)
    return int(y), int(u), int(v)


def shape_mask(shape: str, cx: float, cy: float, size: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Boolean [len(ys), len(xs)] mask of `shape` (side/diameter `size`, centre cx, cy) at pixel centres.

    Triangles point up: the apex is at the top of the bounding square, the base at the bottom.
    """
    dx = xs[None, :] - cx
    dy = ys[:, None] - cy
    half = size / 2.0
    if shape == "circle":
        return dx * dx + dy * dy <= half * half
    if shape == "square":
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= half
    if shape == "triangle":
        from_top = dy + half  # 0 at the apex, `size` at the base
        return (from_top >= 0) & (from_top <= size) & (np.abs(dx) <= from_top / 2.0)
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def _paint(plane: np.ndarray, scale: int, sprite: Sprite, value: int) -> None:
    """Paint `sprite` into one plane whose pixels are `scale` luma pixels wide (1 luma, 2 chroma)."""
    h, w = plane.shape
    half = sprite.size / 2.0
    x0 = max(int(np.floor((sprite.cx - half) / scale)), 0)
    x1 = min(int(np.ceil((sprite.cx + half) / scale)) + 1, w)
    y0 = max(int(np.floor((sprite.cy - half) / scale)), 0)
    y1 = min(int(np.ceil((sprite.cy + half) / scale)) + 1, h)
    if x0 >= x1 or y0 >= y1:
        return
    xs = (np.arange(x0, x1) + 0.5) * scale
    ys = (np.arange(y0, y1) + 0.5) * scale
    mask = shape_mask(sprite.shape, sprite.cx, sprite.cy, sprite.size, xs, ys)
    plane[y0:y1, x0:x1][mask] = value


def make_background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A muted, gently textured [H, W, 3] uint8 RGB background, different per rng, never near PALETTE.

    Base grey 70..140 with a small tint, a linear gradient (+-10) in a random direction and faint
    stripes (+-4). Retries with new draws (deterministic for the rng) until every pixel keeps
    BACKGROUND_MIN_DISTANCE from every palette colour.
    """
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    for _ in range(100):
        base = rng.uniform(70, 140) + rng.uniform(-15, 15, size=3)
        angle = rng.uniform(0, 2 * np.pi)
        ramp = (np.cos(angle) * xx / width + np.sin(angle) * yy / height) * 20.0 - 10.0
        period = rng.uniform(12, 40)
        stripes = 4.0 * np.sin(2 * np.pi * (xx + yy) / period)
        img = np.clip(np.rint(base[None, None, :] + (ramp + stripes)[..., None]), 0, 255).astype(np.uint8)
        if _far_from_palette(img):
            return img
    raise RuntimeError("could not draw a background far from the palette in 100 tries; widen PALETTE gaps")


def _far_from_palette(img: np.ndarray) -> bool:
    """True when no pixel of `img` is within BACKGROUND_MIN_DISTANCE (all channels) of a palette colour."""
    colours = np.unique(img.reshape(-1, 3), axis=0).astype(np.int32)
    for rgb in PALETTE.values():
        if (np.abs(colours - np.array(rgb)).max(axis=1) <= BACKGROUND_MIN_DISTANCE).any():
            return False
    return True


def background_planes(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[H, W, 3] RGB -> (Y [H, W], U [H/2, W/2], V [H/2, W/2]) uint8; chroma is the 2x2 block mean."""
    yuv = rgb_to_yuv(rgb)
    h, w = rgb.shape[:2]
    blocks = yuv.reshape(h // 2, 2, w // 2, 2, 3).mean(axis=(1, 3))
    to_u8 = lambda a: np.clip(np.rint(a), 0, 255).astype(np.uint8)  # noqa: E731
    return to_u8(yuv[..., 0]), to_u8(blocks[..., 1]), to_u8(blocks[..., 2])


def render_frame(planes: tuple[np.ndarray, np.ndarray, np.ndarray], sprites: Iterable[Sprite]) -> np.ndarray:
    """Background planes + sprites -> one [3H/2, W] uint8 array in PyAV's packed yuv420p layout."""
    y, u, v = (p.copy() for p in planes)
    for sprite in sprites:
        _paint(y, 1, sprite, sprite.yuv[0])
        _paint(u, 2, sprite, sprite.yuv[1])
        _paint(v, 2, sprite, sprite.yuv[2])
    width = y.shape[1]
    return np.concatenate([y.reshape(-1), u.reshape(-1), v.reshape(-1)]).reshape(-1, width)


def encode_video(path: Path, frames: Iterable[np.ndarray], width: int, height: int, fps: float,
                 gop: int | None = None) -> int:
    """Write H.264 yuv420p frames to an mp4 at `path`; returns the number of frames written.

    Byte-deterministic: one x264 thread, no B-frames (keeps decoders' frame counts exact), and
    `bitexact` so the muxer writes no library version or creation time. A key frame every `gop` frames
    (default: every 2 seconds).
    """
    rate = Fraction(fps).limit_denominator(1001)
    keyint = gop or max(1, round(2 * fps))
    options = {"preset": "veryfast", "crf": "23", "threads": "1", "bf": "0", "g": str(keyint)}
    count = 0
    with av.open(str(path), "w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=rate, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = 1 / rate
        _tag_bt601(stream.codec_context)
        for array in frames:
            frame = av.VideoFrame.from_ndarray(array, format="yuv420p")
            frame.pts = count
            container.mux(stream.encode(frame))
            count += 1
        container.mux(stream.encode(None))
    return count


def encode_panning_video(path: Path, seconds: float, width: int = 1280, height: int = 720, fps: float = 30.0,
                         gop: int = 250, seed: int = 0) -> int:
    """A long video to time decoders on: a textured background panning 2 pixels a frame (every block moves, as in a
    camera pan; the view jumps back to the top every height / 2 frames, a cut) under four shapes moving at different
    speeds; a key frame every `gop` frames (x264's default 250). No events or annotations. Returns the frames written
    (seconds x fps). Byte-deterministic, as `encode_video`."""
    rng = np.random.default_rng(seed)
    y, u, v = background_planes(make_background(rng, width, 2 * height))  # the view slides down this
    colours = [colour_yuv(PALETTE[c]) for c in ("red", "green", "blue", "yellow")]
    n = round(seconds * fps)

    def frames() -> Iterator[np.ndarray]:
        for i in range(n):
            top = (2 * i) % height  # even, so the chroma rows start at top / 2
            view = (y[top:top + height], u[top // 2:(top + height) // 2], v[top // 2:(top + height) // 2])
            sprites = [Sprite(SHAPES[k], (40 + i * (k + 1) * 3) % width, height * (k + 1) / 5, height / 8 + 8 * k,
                              colours[k]) for k in range(4)]
            yield render_frame(view, sprites)

    return encode_video(path, frames(), width, height, fps, gop=gop)


def _tag_bt601(ctx) -> None:
    """Mark the stream as BT.601 limited range so players convert back the way we converted."""
    ctx.color_range = 1  # AVCOL_RANGE_MPEG (limited)
    ctx.colorspace = 6  # AVCOL_SPC_SMPTE170M
    ctx.color_primaries = 6  # AVCOL_PRI_SMPTE170M
    ctx.color_trc = 6  # AVCOL_TRC_SMPTE170M
