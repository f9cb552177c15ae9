"""Crash-safe file primitives of the run directory: atomic writes, whole-line JSONL appends, tolerant JSONL reads.

A file is either replaced atomically (temp file in the same folder, fsync, `os.replace`) or appended one whole line
at a time (one `os.write` of line + "\\n", then fsync). So after a kill only the last line of a JSONL file can be
damaged; `read_jsonl` skips it and `repair_tail` cuts it off before the next append.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path, PurePath

from mmpg.errors import UserError
from mmpg.runs.layout import LAYOUT_VERSION

log = logging.getLogger("mmpg.runs")

_reported_tails: set[tuple[str, int]] = set()  # (file, line) of damaged last lines already logged


def jsonable(obj):
    """`obj` with NaN/inf floats as None, numpy/torch values as Python numbers or lists, tuples as lists, paths as str.

    Raises TypeError naming the type for anything JSON cannot hold, so a bad metric fails at the write, not later.
    """
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, dict):
        return {(k if isinstance(k, str) else str(k)): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    tolist = getattr(obj, "tolist", None)  # numpy scalars and arrays, torch tensors (without importing either)
    if callable(tolist):
        return jsonable(tolist())
    raise TypeError(f"cannot write a {type(obj).__name__} to a run file: {obj!r:.80}")


def dumps_line(obj) -> bytes:
    """One JSON line as UTF-8 bytes, newline included; NaN/inf become null (`allow_nan=False` guards it)."""
    text = json.dumps(jsonable(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    # A lone surrogate (only possible inside a JSON string) becomes the JSON escape \udcxx: still valid JSON.
    return text.encode("utf-8", "backslashreplace") + b"\n"


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (best effort: not every filesystem lets a folder be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to a temp file next to `path`, fsync it, then `os.replace` it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> Path:
    """Pretty JSON (NaN/inf as null), replaced atomically."""
    text = json.dumps(jsonable(obj), ensure_ascii=False, allow_nan=False, indent=2)
    return atomic_write_bytes(path, text.encode("utf-8", "backslashreplace") + b"\n")


def atomic_write_jsonl(path: str | os.PathLike, records) -> Path:
    return atomic_write_bytes(path, b"".join(dumps_line(r) for r in records))


def append_line(path: str | os.PathLike, obj) -> None:
    """Append one whole JSON line: a single write of line + newline, then fsync."""
    data = dumps_line(obj)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:  # one write in practice; a short write on a regular file only if the disk fills up
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _parse(raw: bytes):
    """The JSON object on one line, or None if the line is damaged (cut short, garbled, not an object)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def check_version(obj: dict, where: str) -> None:
    v = obj.get("v", LAYOUT_VERSION)
    if isinstance(v, int) and v > LAYOUT_VERSION:
        raise UserError(
            f"{where}: written with run layout version {v}, this mmpg reads up to {LAYOUT_VERSION}; upgrade mmpg"
        )


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every JSON object of a JSONL file, in order; blank lines are skipped.

    A damaged LAST line (a writer killed mid-line) is skipped and logged once at debug level. A damaged line
    elsewhere raises UserError (a ValueError) naming file:line; so does a line with "v" newer than LAYOUT_VERSION.
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        obj = _parse(raw)
        if obj is None:
            if i == len(lines) - 1:
                if (str(path), i + 1) not in _reported_tails:
                    _reported_tails.add((str(path), i + 1))
                    log.debug("%s:%d: skipping a cut-short last line (%d bytes)", path, i + 1, len(raw))
                continue
            raise UserError(
                f"{path}:{i + 1}: not a JSON object (damaged line in the middle of the file); "
                "fix or delete that line"
            )
        check_version(obj, f"{path}:{i + 1}")
        records.append(obj)
    return records


def repair_tail(path: str | os.PathLike) -> bool:
    """Cut off a damaged last line (or end a complete one with its missing newline) so appending keeps the file
    readable. Returns True if the file was changed. Only the last 16 MiB are examined."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size == 0:
        return False
    with open(path, "rb+") as f:
        start = max(0, size - (16 << 20))
        f.seek(start)
        tail = f.read()
        body = tail.rstrip(b"\n")
        cut = body.rfind(b"\n") + 1  # start of the last line within `tail`; 0 if no newline in the window
        last = body[cut:]
        if not last.strip() or (cut == 0 and start > 0):
            return False  # only blank lines at the end, or a last line longer than the window: leave it
        if _parse(last) is not None:
            if tail.endswith(b"\n"):
                return False
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        else:
            f.truncate(start + cut)
            log.warning("%s: dropped a cut-short last line (%d bytes) left by a killed writer", path, len(last))
        f.flush()
        os.fsync(f.fileno())
    return True


def resolve_inside(root: str | os.PathLike, relpath: str | os.PathLike, what: str = "the run directory") -> Path:
    """The real path of `relpath` inside `root`; UserError for anything that would leave it (an absolute path,
    '..', or a symlink pointing outside). Every file a reader hands out goes through here."""
    rel = PurePath(relpath)
    if rel.is_absolute() or rel.anchor or ".." in rel.parts:
        raise UserError(f"{os.fspath(relpath)!r}: only paths inside {what} are allowed")
    base = Path(root).resolve()
    full = (base / rel).resolve()
    if not full.is_relative_to(base):
        raise UserError(f"{os.fspath(relpath)!r} leads outside {what} {base} (through a symlink)")
    return full
