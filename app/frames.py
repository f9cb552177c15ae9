"""The frames of a group or an evaluation sample: the run's stored thumbnails, else frames decoded on demand when
the video file still exists, else a note saying why there is nothing to show.

Two views: a strip of evenly spaced frames (the whole video), and the frames that show the event (`event_frames`),
drawn on the timeline's time axis: decoded at chosen times when the video is there,

    truth [s, e]:  s - pad, s, (s + e) / 2, e, e + pad          pad = max(1 s, (e - s) / 2)
    chosen span [ŝ, ê] (the response on show): ŝ, (ŝ + ê) / 2, ê   (dropped when within 2 % of the video of another)

else the stored thumbnails nearest those times (the note says when none falls inside the truth).

The strip is plain HTML. A thumbnail is an <img> whose URL is Gradio's file route for a path from
`RunReader.thumbnails`, which resolves every path inside the run directory (a path or symlink leading out is
refused there, and the server's allowed_paths is that folder alone). Decoded frames are inlined as small JPEG data
URLs: the video file itself is never served.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import threading
import urllib.parse
from collections import OrderedDict
from pathlib import Path

import numpy as np

from mmpg.errors import UserError

Item = tuple[object, str]  # (Path of a JPEG inside the run directory | HxWx3 uint8 array, caption)

_DECODED: OrderedDict[tuple, list] = OrderedDict()  # (path, mtime, size, what, width) -> [(frame, s)]; a few
_DECODED_MAX = 24
_LOCK = threading.Lock()


def thumbnail_items(reader, media_key: str | None) -> tuple[list[Item], str]:
    """(items, note) from a run's stored thumbnails; note names missing files. ([], why) if there are none."""
    if not media_key:
        return [], "no thumbnails were stored for this video"
    try:
        paths, times = reader.thumbnails(media_key)
    except (UserError, OSError, ValueError) as e:
        return [], f"thumbnails not readable: {e}"
    if not paths:
        return [], f"no thumbnails under media/{media_key}"
    items, missing = [], 0
    for p, t in zip(paths, times + [math.nan] * (len(paths) - len(times))):
        if p.is_file():
            items.append((p, _time_caption(t)))
        else:
            missing += 1
    note = f"{missing} of {len(paths)} thumbnails missing under media/{media_key}" if missing else ""
    return items, note


def decoded_items(video: str, count: int = 8, width: int = 256) -> tuple[list[Item], str]:
    """(items, note): `count` frames spread over the video, decoded with decord and shrunk to `width` pixels.
    ([], why) when the file is gone or cannot be decoded."""

    def spread(n: int, fps: float) -> list[int]:
        return sorted({min(n - 1, int((i + 0.5) * n / count)) for i in range(count)})

    frames, why = _decoded(video, ("spread", count), spread, width)
    if why:
        return [], why
    return [(f, _time_caption(t)) for f, t in frames], "frames decoded from the video file"


def _decoded(video: str, what: tuple, pick, width: int) -> tuple[list[tuple[np.ndarray, float]], str]:
    """([(frame, seconds)], "") for the frames `pick(n_frames, fps) -> [index]` chooses, decoded with decord, shrunk
    to `width` pixels and cached by (file, mtime, size, `what`, width); ([], why) when the file is gone or cannot be
    decoded (seconds are NaN without a frame rate)."""
    try:
        st = os.stat(video)
    except OSError:
        return [], f"video file not available: {video}"
    key = (video, st.st_mtime_ns, st.st_size, what, width)
    with _LOCK:
        if key in _DECODED:
            _DECODED.move_to_end(key)
            return _DECODED[key], ""
    try:
        import decord  # only when a video is decoded; the rest of the app never needs it
        from PIL import Image

        vr = decord.VideoReader(video, num_threads=1)
        n, fps = len(vr), float(vr.get_avg_fps() or 0.0)
        if n == 0:
            raise ValueError("no frames")
        idx = pick(n, fps)
        out = []
        for i, f in zip(idx, vr.get_batch(idx).asnumpy()):  # [T, H, W, 3] uint8
            img = Image.fromarray(f)
            if img.width > width:
                img = img.resize((width, max(1, round(img.height * width / img.width))))
            out.append((np.asarray(img), i / fps if fps > 0 else math.nan))
    except Exception as e:  # a corrupt or unsupported file: say so, never fail the page
        return [], f"video file could not be decoded ({type(e).__name__}: {str(e)[:200]})"
    with _LOCK:
        _DECODED[key] = out
        while len(_DECODED) > _DECODED_MAX:
            _DECODED.popitem(last=False)
    return out, ""


EventFrame = tuple[object, float, str]  # (Path | HxWx3 array, seconds, kind: "truth", "pred" or "around")


def event_times(gt: list[float], pred: list[float] | None, duration: float) -> list[tuple[float, str]]:
    """[(seconds, kind)] sorted by time: inside and around the truth, inside the chosen predicted span."""
    end = duration if duration and math.isfinite(duration) and duration > 0 else max(gt[1], (pred or gt)[1])
    s, e = min(gt), max(gt)
    pad = max(1.0, (e - s) / 2)
    wanted = [(s - pad, "around"), (s, "truth"), ((s + e) / 2, "truth"), (e, "truth"), (e + pad, "around")]
    if pred is not None and all(math.isfinite(x) for x in pred):
        a, b = min(pred), max(pred)
        wanted += [(a, "pred"), ((a + b) / 2, "pred"), (b, "pred")]
    out: list[tuple[float, str]] = []
    for t, kind in sorted(((min(max(t, 0.0), end), k) for t, k in wanted), key=lambda x: x[0]):
        near = [i for i, (u, _) in enumerate(out) if abs(u - t) < 0.02 * end]
        if not near:
            out.append((t, kind))
        elif kind == "truth":  # a frame both in the truth and elsewhere is marked as the truth's
            out[near[0]] = (out[near[0]][0], kind)
    return out


def event_frames(reader, media_key: str | None, video: str, gt: list[float], pred: list[float] | None,
                 duration: float) -> tuple[list[EventFrame], str]:
    """(frames, note) that show the event; see the module docstring."""
    wanted = event_times(gt, pred, duration)
    decoded, why = decoded_at(video, [t for t, _ in wanted])
    if decoded:
        return [(a, t, kind) for (a, t), (_, kind) in zip(decoded, wanted)], ""
    items_times: list[tuple[Path, float]] = []
    if reader is not None and media_key:
        try:
            paths, times = reader.thumbnails(media_key)
            items_times = [(p, t) for p, t in zip(paths, times) if math.isfinite(t) and p.is_file()]
        except (UserError, OSError, ValueError):
            items_times = []
    if not items_times:
        return [], why
    s, e = min(gt), max(gt)
    chosen: dict[int, str] = {}
    for t, kind in wanted:  # the nearest stored thumbnail to each wanted time
        i = min(range(len(items_times)), key=lambda j: abs(items_times[j][1] - t))
        chosen.setdefault(i, kind)
    frames = [(items_times[i][0], items_times[i][1], "truth" if s <= items_times[i][1] <= e else
               ("around" if kind == "truth" else kind)) for i, kind in sorted(chosen.items())]
    note = "" if any(k == "truth" for _, _, k in frames) else (
        f"none of the {len(items_times)} stored thumbnails falls inside the truth ({s:g}–{e:g} s) and the video "
        f"file is not available ({video})")
    return frames, note


def event_strip(reader, media_key: str | None, video: str, gt: list[float], duration: float,
                count: int = 12) -> tuple[list[Item], str]:
    """(items, note): `count` frames evenly over [s - pad, e + pad] (the truth and around it, as event_times), decoded
    from the video; else the stored thumbnails in that window; else ([], why)."""
    s, e = min(gt), max(gt)
    pad = max(1.0, (e - s) / 2)
    end = duration if duration and math.isfinite(duration) and duration > 0 else e + pad
    lo, hi = max(0.0, s - pad), min(end, e + pad)
    times = [lo + (hi - lo) * i / max(1, count - 1) for i in range(count)]
    decoded, why = decoded_at(video, times)
    if decoded:
        return [(a, _time_caption(t) + (" · truth" if s <= t <= e else "")) for a, t in decoded], ""
    items, note = thumbnail_items(reader, media_key) if reader is not None else ([], "")
    inside = [(p, c) for (p, c), t in zip(items, _thumb_times(reader, media_key)) if lo <= t <= hi]
    if inside:
        return inside, f"{why}; the stored thumbnails between {lo:.1f} and {hi:.1f} s instead"
    return [], "; ".join(x for x in (why, note, f"no stored thumbnail between {lo:.1f} and {hi:.1f} s") if x)


def _thumb_times(reader, media_key: str | None) -> list[float]:
    try:
        paths, times = reader.thumbnails(media_key) if reader is not None and media_key else ([], [])
    except (UserError, OSError, ValueError):
        return []
    return [t for p, t in zip(paths, times) if p.is_file()]


def decoded_at(video: str, times: list[float], width: int = 256) -> tuple[list[tuple[np.ndarray, float]], str]:
    """([(frame, seconds)], note): the frames nearest `times`, decoded with decord; ([], why) when impossible."""

    def nearest(n: int, fps: float) -> list[int]:
        if fps <= 0:
            raise ValueError("no frames or no frame rate")
        return [min(n - 1, max(0, round(t * fps))) for t in times]

    return _decoded(video, ("at", tuple(round(t, 3) for t in times)), nearest, width)


def frame_src(x) -> str:
    """The URL of a frame: Gradio's file route for a stored thumbnail, a JPEG data URL for a decoded array."""
    return _src(x)


def frame_items(reader, media_key: str | None, video: str) -> tuple[list[Item], str]:
    """Thumbnails when stored, else decoded frames when the video is there; the note says which, or what is
    missing."""
    items, note = thumbnail_items(reader, media_key) if reader is not None else ([], "")
    if items:
        return items, note
    decoded, why = decoded_items(video)
    if decoded:
        return decoded, "; ".join(x for x in (note, why) if x)
    return [], "; ".join(x for x in (note, why) if x)


def strip_html(items: list[Item]) -> str:
    """The frames side by side, each with its time; hovering one enlarges it."""
    if not items:
        return ""
    cells = "".join(f'<figure><img src="{_src(x)}" alt="frame at {html.escape(c)}" loading="lazy">'
                    f"<figcaption>{html.escape(c)}</figcaption></figure>" for x, c in items)
    return f'<div class="mmpg-strip">{cells}</div>'


def _src(x) -> str:
    if isinstance(x, Path):  # already resolved inside the folder the server was opened on
        return "gradio_api/file=" + urllib.parse.quote(str(x))  # relative: also right under a root_path
    buf = io.BytesIO()
    from PIL import Image

    Image.fromarray(np.asarray(x)).save(buf, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _time_caption(t: float) -> str:
    return f"{t:.1f} s" if t is not None and math.isfinite(t) else ""
