"""The frame strip of a group or an evaluation sample: the run's stored thumbnails, else a few frames decoded on
demand when the video file still exists, else a note saying why there is nothing to show.

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

_DECODED: OrderedDict[tuple, list[Item]] = OrderedDict()  # (path, mtime, size, count) -> frames; a few videos
_DECODED_MAX = 8
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
    try:
        st = os.stat(video)
    except OSError:
        return [], f"video file not available: {video}"
    key = (video, st.st_mtime_ns, st.st_size, count, width)
    with _LOCK:
        if key in _DECODED:
            _DECODED.move_to_end(key)
            return _DECODED[key], "frames decoded from the video file"
    try:
        items = _decode(video, count, width)
    except Exception as e:  # a corrupt or unsupported file: say so, never fail the page
        return [], f"video file could not be decoded ({type(e).__name__}: {str(e)[:200]})"
    with _LOCK:
        _DECODED[key] = items
        while len(_DECODED) > _DECODED_MAX:
            _DECODED.popitem(last=False)
    return items, "frames decoded from the video file"


def _decode(video: str, count: int, width: int) -> list[Item]:
    import decord  # only when a video is decoded; the rest of the app never needs it
    from PIL import Image

    vr = decord.VideoReader(video, num_threads=1)
    n, fps = len(vr), float(vr.get_avg_fps() or 0.0)
    if n == 0:
        raise ValueError("no frames")
    idx = sorted({min(n - 1, int((i + 0.5) * n / count)) for i in range(count)})
    frames = vr.get_batch(idx).asnumpy()  # [T, H, W, 3] uint8
    out = []
    for i, f in zip(idx, frames):
        img = Image.fromarray(f)
        if img.width > width:
            img = img.resize((width, max(1, round(img.height * width / img.width))))
        out.append((np.asarray(img), _time_caption(i / fps if fps > 0 else math.nan)))
    return out


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
