"""A decoded-frame cache on local disk (`data.frame_cache`): a video's frames after sampling and resizing, kept so a
second epoch (or a run after `mmpg prepare-videos`) reads them instead of decoding the file again.

    key   = sha256 of {the file's realpath, size and mtime (ns); every VideoSpec field; the clip window;
                       qwen-vl-utils' video constants and reader; the versions of qwen-vl-utils, decord, torchvision;
                       FORMAT_VERSION}
    entry = ROOT/<key[:2]>/<key>.frames:
            MAGIC (8 bytes) | header length (4 bytes, little endian) | header (JSON) | frames (raw uint8, T*C*H*W)

The header holds the shape, timestamps, sample fps, qwen-vl-utils' metadata, the path, the duration, the payload's
length and its CRC-32. Under sequence parallelism a rank keeps only its frames (`load_part`): its entry's key adds
(rank, sp) and its header says where the part sits in the whole (first frame, whole frame count); a whole video's
entry (`mmpg prepare-videos`) serves every rank, each cutting its part from it. Frames come out of qwen-vl-utils
as float32 holding whole numbers 0..255 (torchvision's resize of the uint8 decode stays uint8), so uint8 storage is
exact; frames that are not (a future qwen-vl-utils) are not cached, never rounded. An entry is written to a temp
file in its folder and renamed into place (`os.replace`): processes filling the same entry at once leave one whole
entry. An entry that is short, has a bad header, a wrong
shape or a checksum that does not match is deleted and the video decoded again (one log line), never trusted. A
read touches the entry's mtime; after a write, entries are deleted oldest first until the folder is under its cap
(least recently used).

Format, by measurement (docs/data.md, "The decoded-frame cache"): raw uint8. Raw and zlib level 1 both read at least
12x faster than a decode; zlib made synthetic frames 22x smaller but frames with noise only 1.1x (real footage is
nearer the latter) and cost 1.7-3.1x the read time, so raw: the fastest read and a disk cost known in advance.

Disk per video: T*H*W*3 bytes, at most 2 x total_pixels x 3 (two frames make one temporal patch, so the frames of
a video hold twice its pixel budget). At the long config (configs/grounding_qwen25vl_7b_long.yaml: 1 fps, <= 768
frames, <= 200,704 pixels a frame, total_pixels 51,380,224) a 16:9 video takes 36 MB a minute up to ~8.5 minutes,
~300 MB at most, 276 MB from 13 minutes on (768 frames of 252x476); an hour of footage is ~2.1 GB in clips of a few
minutes, 0.83 GB as 20-minute videos, 0.28 GB as one hour-long video (qwen-vl-utils' sizing, docs/data.md).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
import zlib
from pathlib import Path

import torch

from mmpg.data.video import DecodedVideo, VideoPart, VideoSpec, load_video, load_video_part

log = logging.getLogger("mmpg.data")

FORMAT_VERSION = 1
MAGIC = b"MMPGFRM1"
SUFFIX = ".frames"
GB = 10 ** 9
STALE_TEMP_S = 3600.0  # a temp file older than this was left by a killed writer: removed when evicting


@functools.cache
def _decoder_identity() -> dict:
    """What else changes the frames: the libraries' versions and qwen-vl-utils' video constants and reader."""
    from importlib.metadata import PackageNotFoundError, version

    from qwen_vl_utils import vision_process

    versions = {}
    for name in ("qwen-vl-utils", "decord", "torchvision"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    constants = {k: getattr(vision_process, k) for k in dir(vision_process)
                 if k.isupper() and isinstance(getattr(vision_process, k), (int, float, str, type(None)))}
    return {"versions": versions, "qwen_vl_utils": constants}


def cache_key(path: str, spec: VideoSpec, clip_start: float | None, clip_end: float | None,
              part: tuple[int, int] | None = None) -> str | None:
    """The entry's name (64 hex digits) for these frames, or None when the file cannot be stat'ed (no entry: the
    decoder then says why the file cannot be used). part: (rank, sp) for one sequence-parallel rank's frames."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    identity = {"format": FORMAT_VERSION, "file": [real, st.st_size, st.st_mtime_ns],
                "spec": dataclasses.asdict(spec), "clip": [clip_start, clip_end], **_decoder_identity()}
    if part is not None:
        identity["part"] = list(part)
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class BadEntry(Exception):
    """A cache file that cannot be trusted; the message says why."""


class FrameCache:
    """Decoded frames under `root`, at most `max_bytes` of entries. Picklable (DataLoader workers get a copy)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = int(max_bytes)

    def __repr__(self) -> str:
        return f"FrameCache({str(self.root)!r}, {self.max_bytes / GB:g} GB)"

    def entry_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def load(self, path: str, spec: VideoSpec, clip_start: float | None = None, clip_end: float | None = None,
             decode=load_video) -> tuple[DecodedVideo, bool]:
        """(the frames, True) from the cache, else (decode(path, spec, clip_start, clip_end), False), stored for next
        time. Raises what `decode` raises (VideoError for a file that cannot be used)."""
        key = cache_key(path, spec, clip_start, clip_end)
        if key is not None:
            video = self.get(key, path)
            if video is not None:
                return video, True
        video = decode(path, spec, clip_start, clip_end)
        if key is not None:
            self.put(key, video)
        return video, False

    def frames(self, path: str, spec: VideoSpec, clip_start: float | None = None,
               clip_end: float | None = None) -> DecodedVideo:
        """The frames alone (`load` without whether they were cached): a decode shaped like `load_video`, as the zoom
        tool takes one (`ZoomEnvironment(decode=)`)."""
        return self.load(path, spec, clip_start, clip_end)[0]

    def load_part(self, path: str, spec: VideoSpec, clip_start: float | None = None, clip_end: float | None = None,
                  *, rank: int, sp: int, decode=load_video_part) -> tuple[VideoPart, bool]:
        """Rank `rank` of `sp`'s frames: (its part entry, True), else (the whole video's entry cut to its part, True:
        what `mmpg prepare-videos` stores), else (decode(path, spec, clip_start, clip_end, rank=, sp=), False),
        stored as its part entry. Raises what `decode` raises."""
        key = cache_key(path, spec, clip_start, clip_end, (rank, sp))
        if key is not None:
            video = self.get(key, path)
            if isinstance(video, VideoPart):
                return video, True
            whole = self.get(cache_key(path, spec, clip_start, clip_end), path)
            if isinstance(whole, DecodedVideo):
                return whole.part(rank, sp), True
        video = decode(path, spec, clip_start, clip_end, rank=rank, sp=sp)
        if key is not None:
            self.put(key, video)
        return video, False

    def get(self, key: str, path: str) -> DecodedVideo | VideoPart | None:
        """The entry's frames (their `path` set to `path`, as the decoder would; a `VideoPart` for a part entry), or
        None when there is none or it cannot be trusted (then it is deleted)."""
        file = self.entry_path(key)
        try:
            with open(file, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                got = f.readinto(data)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.info("frame cache: cannot read %s (%s); decoding %s", file, e, path)
            return None
        try:
            header, offset = _parse(data, got, key)
        except BadEntry as e:
            log.info("frame cache: %s is not a good entry (%s); decoding %s again", file, e, path)
            _remove(file)
            return None
        try:
            os.utime(file)  # least recently used: a read makes the entry young again
        except OSError:
            pass
        frames = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=header["payload_bytes"]) \
            if header["payload_bytes"] else torch.empty(0, dtype=torch.uint8)
        common = dict(frames=frames.view(header["shape"]).float(), timestamps=header["timestamps"],
                      sample_fps=header["sample_fps"], metadata=header["metadata"], path=str(path),
                      duration=header["duration"])
        if "part" in header:
            first, whole, rank, sp = header["part"]
            return VideoPart(first_frame=first, whole_frames=whole, rank=rank, sp=sp, **common)
        return DecodedVideo(**common)

    def has(self, key: str) -> bool:
        """Whether a whole entry is there (header and length checked, the checksum not: `get` checks it on use)."""
        file = self.entry_path(key)
        try:
            with open(file, "rb") as f:
                head = f.read(12)
                if len(head) < 12 or head[:8] != MAGIC:
                    return False
                header = json.loads(f.read(struct.unpack("<I", head[8:])[0]))
                return os.fstat(f.fileno()).st_size == f.tell() + header["payload_bytes"]
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return False

    def put(self, key: str, video: DecodedVideo | VideoPart) -> bool:
        """Store `video` under `key` (atomic rename), then evict down to the cap; False when it is not stored (frames
        that are not whole numbers 0..255, or a write that failed: logged, never raised)."""
        u8 = video.frames.to(torch.uint8)
        if not torch.equal(u8.to(video.frames.dtype), video.frames):
            log.info("frame cache: frames of %s are not whole numbers in 0..255; not cached", video.path)
            return False
        payload = u8.contiguous().numpy().tobytes()
        header = {"key": key, "shape": list(u8.shape), "timestamps": list(video.timestamps),
                  "sample_fps": video.sample_fps, "metadata": video.metadata, "path": video.path,
                  "duration": video.duration, "payload_bytes": len(payload), "crc32": zlib.crc32(payload)}
        if isinstance(video, VideoPart):
            header["part"] = [video.first_frame, video.whole_frames, video.rank, video.sp]
        head = json.dumps(header).encode()
        file = self.entry_path(key)
        tmp = None
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".tmp-", suffix=SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(head)) + head)
                f.write(payload)
            os.replace(tmp, file)
        except OSError as e:
            log.warning("frame cache: could not write %s (%s); %s stays uncached", file, e, video.path)
            if tmp is not None:
                _remove(Path(tmp))
            return False
        self.evict(keep=file)
        return True

    def entries(self) -> list[os.DirEntry]:
        """The entry files under the root (temp files left by killed writers removed on the way)."""
        out = []
        now = time.time()
        try:
            folders = [d for d in os.scandir(self.root) if d.is_dir()]
        except FileNotFoundError:
            return out
        for folder in folders:
            try:
                for e in os.scandir(folder.path):
                    if e.name.startswith(".tmp-"):
                        if _age(e, now) > STALE_TEMP_S:
                            _remove(Path(e.path))
                    elif e.name.endswith(SUFFIX):
                        out.append(e)
            except FileNotFoundError:
                continue
        return out

    def size(self) -> tuple[int, int]:
        """(bytes, entries) in the cache now."""
        sizes = [_stat(e) for e in self.entries()]
        return sum(s.st_size for s in sizes if s), sum(1 for s in sizes if s)

    def evict(self, keep: Path | None = None) -> int:
        """Delete the least recently used entries (oldest mtime) until the cache holds at most max_bytes; `keep`
        (the entry just written) stays. Returns the number deleted."""
        stats = [(e.path, s) for e in self.entries() if (s := _stat(e)) is not None]
        total = sum(s.st_size for _, s in stats)
        deleted = 0
        for file, s in sorted(stats, key=lambda x: x[1].st_mtime_ns):
            if total <= self.max_bytes:
                break
            if keep is not None and Path(file) == keep:
                continue
            if _remove(Path(file)):
                deleted += 1
            total -= s.st_size
        if deleted:
            log.debug("frame cache: %d least recently used entries deleted (cap %g GB)", deleted, self.max_bytes / GB)
        return deleted


def open_frame_cache(folder: str, gb: float) -> FrameCache | None:
    """The cache a config names (`data.frame_cache`, `data.frame_cache_gb`); None when the folder is empty (off).
    A folder that cannot be written is a UserError of one line here, not a warning for every video later."""
    if not folder:
        return None
    root = os.path.expanduser(folder)
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        from mmpg.errors import UserError

        raise UserError(f"data.frame_cache={folder}: cannot write there ({e.strerror or e}); name a writable local "
                        "folder, or leave data.frame_cache empty (no cache)") from None
    return FrameCache(root, int(gb * GB))


def _parse(data: bytearray, got: int, key: str) -> tuple[dict, int]:
    """(header, payload offset) of an entry's bytes; BadEntry when any part is wrong."""
    if got != len(data) or len(data) < 12:
        raise BadEntry(f"{len(data)} bytes, shorter than a header")
    if bytes(data[:8]) != MAGIC:
        raise BadEntry("not a frame-cache file (its first bytes)")
    n = struct.unpack("<I", data[8:12])[0]
    try:
        header = json.loads(bytes(data[12:12 + n]))
        shape, length, crc = header["shape"], header["payload_bytes"], header["crc32"]
    except (ValueError, KeyError, TypeError) as e:
        raise BadEntry(f"unreadable header ({type(e).__name__})") from None
    if header.get("key") != key:
        raise BadEntry("the header names another entry")
    # a part may hold no frame (a rank with no temporal patch of a short video); a whole video has one at least
    if len(shape) != 4 or any(not isinstance(d, int) or d <= (0 if i or "part" not in header else -1)
                              for i, d in enumerate(shape)) or \
            shape[0] * shape[1] * shape[2] * shape[3] != length:
        raise BadEntry(f"shape {shape} does not hold {length} bytes")
    if len(data) != 12 + n + length:
        raise BadEntry(f"{len(data) - 12 - n} bytes of frames, the header says {length} (truncated?)")
    if zlib.crc32(memoryview(data)[12 + n:]) != crc:
        raise BadEntry("checksum mismatch")
    return header, 12 + n


def _stat(entry: os.DirEntry):
    try:
        return entry.stat()
    except FileNotFoundError:  # deleted meanwhile by another process
        return None


def _age(entry: os.DirEntry, now: float) -> float:
    s = _stat(entry)
    return now - s.st_mtime if s is not None else 0.0


def _remove(file: Path) -> bool:
    try:
        file.unlink()
        return True
    except OSError:
        return False
