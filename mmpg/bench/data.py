"""`mmpg bench --levels data`: whether decoding keeps up with training on long videos, on one core.

    video     a generated long video: --data-minutes (default 20) of 1280x720, 30 fps H.264, a key frame every 250
              frames (x264's default), a textured background panning under moving shapes
              (`mmpg.toy.render.encode_panning_video`), rendered once into data/generated/bench/ and reused after;
              --data-video FILE times a file of your own instead (real footage decodes slower than this one)
    settings  the video settings of the presets, read from their configs (`SETTINGS`): the 7B config, the long config
              and Time-R1's recipe, each as Qwen2.5-VL sizes frames

Three tables, each figure one decode (a decode of a long video takes tens of seconds), timed in wall seconds and in
CPU seconds of the process (all its decoder threads); rates and ratios are of CPU seconds, which other work on the
machine changes far less than wall time:

    decode  per settings: frames sampled, their size, video tokens, seconds to decode the whole video (the file
            checked, sampled, resized), frames/s, videos/s and seconds of video per second
    sp      at the long settings: each rank's part at sp 2 against the whole decode at sp 1 (the ceiling: the rank's
            share of the frames, 0.5; the slowest rank sets the group's pace), and whether each part equals its
            slice of the whole decode bit for bit
    cache   at the long settings: `FrameCache.load` cold (decode + write, in a temporary folder) and warm (read), its
            entry's size on disk

Everything is measured pinned to one core (--data-core; -1: all the machine's) with one torch thread, so frames/s
is a per-core rate: a node's decode capacity is roughly it times the cores its loaders get. A program that prints
tables and writes JSON, never a test of speed.

Every decode is `load_video_part` (the whole video: rank 0 of sp 1), which equals `load_video` bit for bit
(tests/test_video_parts.py) but resizes 32 frames at a time: `load_video` (qwen-vl-utils' fetch_video) resizes all
of a video's frames at once in float32 at the file's size, ~14 GB at the peak for 768 frames of 720p.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

# label -> config whose data.* video settings are measured (all three are Qwen2.5-VL: patch 14)
SETTINGS = {"7B config": "configs/grounding_qwen25vl_7b.yaml",
            "long config": "configs/grounding_qwen25vl_7b_long.yaml",
            "Time-R1 recipe": "configs/recipes/time_r1_charades.yaml"}
LONG = "long config"  # the settings of the sp and cache tables
FAMILY = "qwen2_5_vl"
VIDEO_DIR = "data/generated/bench"
WIDTH, HEIGHT, FPS, GOP = 1280, 720, 30.0, 250
SP = 2
MB = 10 ** 6


def specs() -> dict:
    """label -> VideoSpec of that config's data settings."""
    from mmpg.config import load_config
    from mmpg.data.video import VideoSpec

    out = {}
    for label, path in SETTINGS.items():
        d = load_config(path, []).data
        out[label] = VideoSpec.for_family(FAMILY, fps=d.fps, min_frames=d.min_frames, max_frames=d.max_frames,
                                          min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                                          total_pixels=d.total_pixels)
    return out


def generated_video(minutes: float, folder: str = VIDEO_DIR, log=print) -> tuple[str, float | None]:
    """(path, seconds spent rendering it, None when an earlier render was reused) of the panning video."""
    from mmpg.toy.render import encode_panning_video

    path = Path(folder) / f"panning_{minutes:g}min_{WIDTH}x{HEIGHT}_{FPS:g}fps_gop{GOP}.mp4"
    if path.is_file() and path.stat().st_size > 0:
        return str(path), None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.mp4")
    log(f"  rendering {path} ({minutes:g} min, {WIDTH}x{HEIGHT}, {FPS:g} fps, one x264 thread) ...")
    start = time.perf_counter()
    try:
        encode_panning_video(tmp, minutes * 60, WIDTH, HEIGHT, FPS, gop=GOP)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return str(path), time.perf_counter() - start


@contextlib.contextmanager
def on_core(core: int):
    """This process on `core` alone, with one torch thread (the decoder's threads follow the affinity); -1: as is."""
    import torch

    if core < 0:
        yield "all cores"
        return
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if core not in before:
        from mmpg.errors import UserError

        raise UserError(f"--data-core {core}: this process may run on cores {sorted(before)}; choose one of them "
                        "(or -1 for all)")
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    try:
        yield f"core {core}"
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def _timed(fn, *args, **kw):
    """(fn's result, wall seconds, CPU seconds of this process: every decoder thread's)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kw)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _decode_row(label: str, video, wall: float, cpu: float) -> dict:
    t, _, h, w = video.frames.shape
    return {"table": "decode", "settings": label, "frames": t, "height": h, "width": w,
            "tokens": t // 2 * (h // 28) * (w // 28), "seconds": wall, "cpu_s": cpu, "frames_per_s": t / cpu,
            "videos_per_s": 1 / cpu, "realtime": video.duration / cpu}


def whole_video(path: str, spec, clip_start=None, clip_end=None):
    """The whole video's DecodedVideo through the part decoder (rank 0 of sp 1)."""
    from mmpg.data.video import load_video_part

    return load_video_part(path, spec, clip_start, clip_end, rank=0, sp=1).as_video()


def measure(path: str, settings: dict, log=print) -> list[dict]:
    """Every row of the three tables for the video at `path` (see the module's docstring)."""
    from mmpg.data.frame_cache import FrameCache

    decodes = {}
    for label, spec in settings.items():
        if label == LONG:
            continue
        log(f"  decoding at the {label}'s settings ...")
        video, wall, cpu = _timed(whole_video, path, spec)
        decodes[label] = _decode_row(label, video, wall, cpu)
        del video
    spec = settings[LONG]
    decoded = {}

    def timed_decode(*args):  # the cold load's decode is the long settings' whole decode, timed on its own
        decoded["video"], decoded["wall"], decoded["cpu"] = _timed(whole_video, *args)
        return decoded["video"]

    with tempfile.TemporaryDirectory(prefix="mmpg-bench-cache-") as folder:
        cache = FrameCache(folder, 10 ** 12)
        log(f"  decoding at the {LONG}'s settings through an empty frame cache ...")
        (whole, hit), cold, cold_cpu = _timed(cache.load, path, spec, decode=timed_decode)
        log("  reading it back from the cache ...")
        (again, warm_hit), warm, warm_cpu = _timed(cache.load, path, spec, decode=timed_decode)
        entry = cache.size()[0]
    decodes[LONG] = _decode_row(LONG, whole, decoded["wall"], decoded["cpu"])
    same = torch_equal(again.frames, whole.frames)
    del again
    rows = [decodes[label] for label in settings]
    rows += [{"table": "cache", "state": "cold", "seconds": cold, "cpu_s": cold_cpu, "hit": hit,
              "entry_bytes": entry},
             {"table": "cache", "state": "warm", "seconds": warm, "cpu_s": warm_cpu, "hit": warm_hit,
              "entry_bytes": entry, "equal": same}]
    rows += _sp_rows(path, spec, whole, decoded["wall"], decoded["cpu"], log)
    return rows


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def _sp_rows(path: str, spec, whole, wall: float, cpu: float, log) -> list[dict]:
    """sp 1 (the whole decode) and each rank of sp 2 (`load_video_part`), with its share of the sp 1 time; the
    ceiling is the rank's share of the temporal groups (1/2 each for an even count)."""
    from mmpg.data.video import load_video_part

    t = whole.frames.shape[0]
    rows = [{"table": "sp", "sp": 1, "rank": 0, "groups": [0, t // 2], "frames": t, "seconds": wall, "cpu_s": cpu,
             "ratio": 1.0, "ceiling": 1.0, "equal": None}]
    for rank in range(SP):
        log(f"  decoding rank {rank}'s part of sp {SP} ...")
        part, seconds, part_cpu = _timed(load_video_part, path, spec, rank=rank, sp=SP)
        a, b = part.groups
        rows.append({"table": "sp", "sp": SP, "rank": rank, "groups": [a, b], "frames": 2 * (b - a),
                     "seconds": seconds, "cpu_s": part_cpu, "ratio": part_cpu / cpu, "ceiling": (b - a) / (t // 2),
                     "equal": torch_equal(part.frames, whole.frames[2 * a:2 * b])
                     and part.metadata == whole.metadata and part.timestamps == whole.timestamps})
    return rows


def _cell(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def format_tables(rows: list[dict]) -> str:
    """The three Markdown tables, as docs/performance.md shows them; rates and ratios are of CPU seconds."""
    out = ["| settings | frames | frame | video tokens | decode s | CPU s | frames/s | videos/s | video s per s |",
           "|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['settings']} | {r['frames']} | {r['height']}x{r['width']} | {r['tokens']:,} | {r['seconds']:.2f} | "
            f"{r['cpu_s']:.2f} | {r['frames_per_s']:.1f} | {r['videos_per_s']:.3f} | {r['realtime']:.1f} |"
            for r in rows if r["table"] == "decode"]
    sp = [r for r in rows if r["table"] == "sp"]
    out += ["", "| sp | rank | temporal groups | frames | decode s | CPU s | of sp 1 | ceiling | equal to its slice |",
            "|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['sp']} | {r['rank']} | {r['groups'][0]}-{r['groups'][1]} | {r['frames']} | {r['seconds']:.2f} | "
            f"{r['cpu_s']:.2f} | {r['ratio']:.2f} | {r['ceiling']:.2f} | "
            f"{'' if r['equal'] is None else 'yes' if r['equal'] else 'NO'} |" for r in sp]
    slowest = max((r for r in sp if r["sp"] > 1), key=lambda r: r["cpu_s"], default=None)
    if slowest:
        out.append(f"| {slowest['sp']} | slowest | | | | {slowest['cpu_s']:.2f} | **{slowest['ratio']:.2f}** | "
                   f"{max(r['ceiling'] for r in sp if r['sp'] > 1):.2f} | |")
    cache = {r["state"]: r for r in rows if r["table"] == "cache"}
    if cache:
        cold = cache["cold"]["cpu_s"]
        out += ["", "| frame cache | load s | CPU s | speed-up | entry MB | from the cache | equal to the decode |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {state} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | {cold / max(r['cpu_s'], 1e-6):.1f}x | "
                f"{r['entry_bytes'] / MB:.0f} | {'yes' if r['hit'] else 'no'} | "
                f"{'' if 'equal' not in r else 'yes' if r['equal'] else 'NO'} |" for state, r in cache.items()]
    return "\n".join(out)


def run(args) -> int:
    """`mmpg bench --levels data`: the video (rendered or given), the three tables on stdout, JSON."""
    from mmpg.bench import tables
    from mmpg.data.video import VideoError, read_duration
    from mmpg.errors import UserError

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    path, render_s, made = args.data_video, None, "given"
    if not path:
        if not args.data_minutes > 0:
            raise UserError(f"--data-minutes {args.data_minutes:g}: the generated video's length in minutes, above 0 "
                            "(e.g. 2)")
        path, render_s = generated_video(args.data_minutes, log=log)
        made = "an earlier render" if render_s is None else f"rendered in {render_s:.0f} s"
    try:
        duration = read_duration(path)
    except VideoError as e:
        raise UserError(f"--data-video: {e}") from None
    settings = specs()
    with on_core(args.data_core) as where:
        print(f"mmpg bench --levels data: {path} ({duration / 60:.1f} min, {made}), decoded on {where}")
        rows = measure(path, settings, log)
    print(format_tables(rows))
    meta = {"level": "data", "argv": sys.argv[1:], "video": path, "duration_s": duration, "render_s": render_s,
            "on": where, **tables.provenance()}
    out = tables.write_json(args.out or tables.default_out_path(), rows, meta)
    print(f"wrote {out}")
    return 0 if all(r.get("equal") is not False for r in rows) else 1
