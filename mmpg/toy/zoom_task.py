"""The toy task where zooming wins: the overview says where to look, only a zoom shows when exactly.

Each video is black with two events: a large coloured square (the *field*) visible for FIELD_S seconds, and inside
that time a small white circle (the *flash*) visible for FLASH_S seconds, in a corner of the frame. The query asks
for the flash. The overview samples the video at `overview_fps` (qwen-vl-utils' sampling, as training decodes it),
and the flash is placed where no overview frame falls, so one look sees the field but never the flash: the best a
single turn can answer is the field's time (tIoU about FLASH_S / FIELD_S). A zoom on the field's window at
`zoom.fps` shows the flash in several frames.

`rule_trajectory` is the rule-based policy that writes the cold start's multi-turn trajectories, as VideoZoomer and
VITAL distil theirs: from the overview frames that show the field, a zoom on the window around them (`rule_window`:
between the overview frames around them, or between the times written before the frame pairs around them); from
the clip's frames that show the flash, the answer, copied from the times the clip writes.
`write_zoom_dataset` writes the videos, the annotations (the captions JSON mmpg reads) and those trajectories
(`trajectories.jsonl`, chat messages with the tool call and the tool's turn, the clip named by its window).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np

from mmpg.errors import UserError
from mmpg.toy import render
from mmpg.toy.scenes import Event, Scene

FIELD_S = (6.0, 8.0)  # how long the field is visible (drawn per video)
FLASH_S = 0.5
QUERY = "the white flash"
FIELD_COLOURS = ("red", "green", "blue", "yellow", "magenta", "cyan", "orange")
WINDOW_RULES = ("frames", "stamps")
SEEN, MISSED = "The flash is visible.", "No flash in the clip."  # the rule's thought before its answer


@dataclasses.dataclass(frozen=True)
class ZoomTask:
    """The task's sizes: videos of `duration` seconds at `fps`, `size` pixels square; the overview's frame rate and
    the zoom tool's (its settings: `mmpg.rollout.zoom.ZoomSettings`)."""

    duration: float = 40.0
    fps: float = 8.0
    size: int = 64
    overview_fps: float = 0.5
    zoom_fps: float = 4.0
    zoom_max_frames: int = 48
    window_rule: str = "frames"
    """How the rule policy picks its zoom window from the overview (`rule_window`): `frames` (between the overview
    frames around the ones showing the field, on the zoom's frame grid) or `stamps` (between the times written
    before the frame pairs around the pairs showing it: numbers a Qwen3-VL prompt holds, copied, not computed)."""

    def problem(self) -> str | None:
        """Why these sizes cannot make the task, or None: the field must fit 2 s from either end, every field must
        hold an overview frame (the overview's widest frame interval, as qwen-vl-utils spreads its frames, below the
        shortest field with a frame to spare on either side) so the rule policy sees it, and the rule's window, from the
        overview frame before the field (on the zoom's frame grid), must reach past the longest field within the
        zoom's frame cap (`stamps`: the written times around the most frame pairs the longest field can show in)."""
        if min(self.duration, self.fps, self.overview_fps, self.zoom_fps, self.zoom_max_frames) <= 0:
            return "the zoom task's duration, frame rates and zoom frames must be > 0"
        if self.window_rule not in WINDOW_RULES:
            return f"window rule {self.window_rule!r}: choose one of {', '.join(WINDOW_RULES)}"
        if self.duration < FIELD_S[1] + 4.0:
            return f"a zoom-task video of {self.duration:g} s is too short: it needs >= {FIELD_S[1] + 4.0:g} s"
        times = self.overview_times()
        interval = max(b - a for a, b in zip(times, times[1:]))
        if interval > FIELD_S[0] - 2.0 / self.fps:
            return (f"an overview at {self.overview_fps:g} fps (frames up to {interval:g} s apart) may miss the "
                    f"{FIELD_S[0]:g}-s square: raise the overview's fps")
        if self.window_rule == "frames":
            widest = interval + FIELD_S[1] + 1.0 / self.zoom_fps
            what = f"an overview interval, the {FIELD_S[1]:g}-s square, a zoom frame"
        else:  # the square shows in at most `pairs` consecutive pairs; the window adds the written times either side
            shortest = min(b - a for a, b in zip(times, times[1:]))
            pairs = int(FIELD_S[1] // shortest + 1) // 2 + 1
            edges = [0.0, *(float(w) for w in written_times(times)), self.duration]
            widest = max(edges[k + pairs + 1] - edges[k] for k in range(len(edges) - pairs - 1))
            what = f"the written times around {pairs} frame pairs"
        widest = round(widest, 6)
        if widest > self.zoom_max_frames / self.zoom_fps:
            need = math.ceil(widest * self.zoom_fps - 1e-9)
            return (f"the rule policy's window must reach {widest:g} s ({what}), past {self.zoom_max_frames} zoom "
                    f"frames at {self.zoom_fps:g} fps: allow >= {need} zoom frames")
        return None

    def overview_times(self) -> list[float]:
        """Seconds of the frames the overview samples (qwen-vl-utils' rule, as `mmpg.data.video` decodes)."""
        from mmpg.data.video import VideoSpec, sampled_indices

        spec = VideoSpec(fps=self.overview_fps, min_frames=4, max_frames=768)
        indices = sampled_indices(spec, "", int(round(self.duration * self.fps)), self.fps)
        return [i / self.fps for i in indices]


def zoom_scenes(n: int, seed: int, task: ZoomTask) -> list[Scene]:
    """The n scenes `write_zoom_dataset(out, n, seed, task)` renders, in its order (video i drawn from its own spawned
    generator; the test split is the last `test_fraction` of them), without rendering anything."""
    return [zoom_scene(rng, f"zoom_{i:05d}", task) for i, rng in enumerate(np.random.default_rng(seed).spawn(n))]


def zoom_scene(rng: np.random.Generator, video_id: str, task: ZoomTask) -> Scene:
    """One video of the task (module docstring), drawn from its own rng: the field somewhere in the video, the
    flash inside it between two overview frames."""
    times = task.overview_times()
    field_len = float(rng.uniform(*FIELD_S))
    start = float(rng.uniform(2.0, task.duration - field_len - 2.0))
    field_start, field_end = round(start * task.fps) / task.fps, round((start + field_len) * task.fps) / task.fps
    frame = 1.0 / task.fps
    gaps = [(max(a, field_start) + frame, min(b, field_end) - frame - FLASH_S)  # flash starts where it misses both
            for a, b in zip(times, times[1:])]
    gaps = [(lo, hi) for lo, hi in gaps if hi > lo]
    lo, hi = gaps[int(rng.integers(len(gaps)))]
    flash_start = round(float(rng.uniform(lo, hi)) * task.fps) / task.fps
    colour = FIELD_COLOURS[int(rng.integers(len(FIELD_COLOURS)))]
    s = float(task.size)
    field = Event(colour, "square", "appears", field_start, field_end, 0.5 * s, (0.4 * s, 0.6 * s), (0.4 * s, 0.6 * s))
    flash = Event("white", "circle", "appears", flash_start, flash_start + FLASH_S, 0.25 * s, (0.82 * s, 0.18 * s),
                  (0.82 * s, 0.18 * s))
    n = int(round(task.duration * task.fps))
    return Scene(video_id, task.fps, task.size, task.size, n, round(n / task.fps, 3), (field, flash))


def _visible(scene: Scene, event: int, t: float) -> bool:
    return scene.events[event].colour_at(t) is not None


def clip_times(scene: Scene, task: ZoomTask, start: float, end: float) -> list[float]:
    """Seconds of the frames a zoom on [start, end] shows: the tool's sampling (`ZoomEnvironment`'s spec: the zoom's
    frame rate, 2 to `zoom_max_frames` frames, qwen-vl-utils' rule over the window), without decoding."""
    from mmpg.data.video import VideoSpec, sampled_indices

    spec = VideoSpec(fps=task.zoom_fps, min_frames=2, max_frames=task.zoom_max_frames)
    return [i / scene.fps for i in sampled_indices(spec, "", scene.n_frames, scene.fps, start, end)]


def written_times(times: list[float]) -> list[str]:
    """The time written for each pair of frames (the temporal patch both families merge): the mean of its two
    frames' times to 0.1 s, as Qwen3-VL's processor writes `<t seconds>` before the pair (an odd last frame is paired
    with itself, as the processor pads it)."""
    padded = list(times) + list(times[-1:]) * (len(times) % 2)
    return [f"{(padded[k] + padded[k + 1]) / 2:.1f}" for k in range(0, len(padded), 2)]


def flash_pairs(scene: Scene, task: ZoomTask, start: float, end: float) -> list[bool]:
    """For each pair of frames a zoom on [start, end] shows (each pair one written time, `written_times`): whether
    one of its two frames shows the flash (an odd last frame pairs with itself)."""
    times = clip_times(scene, task, start, end)
    return [any(_visible(scene, 1, t) for t in times[k: k + 2]) for k in range(0, len(times), 2)]


def rule_window(scene: Scene, task: ZoomTask) -> tuple[float, float]:
    """The rule policy's zoom window, read off the overview frames only. `task.window_rule` `frames`: from the
    overview frame before the first one that shows the field to the one after the last, on the zoom's frame grid,
    at most `zoom_max_frames` frames long. `stamps`: from the time written before the pair of overview frames ahead
    of the first pair that shows the field to the time written before the pair after the last one (0 and the
    video's end past the first and last pairs): what a Qwen3-VL prompt writes, so the call copies two of its numbers
    where the `frames` window asks for arithmetic on times the prompt never writes (`ZoomTask.problem` checks that
    it fits the zoom's frames)."""
    times = task.overview_times()
    if task.window_rule == "stamps":
        stamps = [float(w) for w in written_times(times)]
        pairs = [k for k in range(len(stamps)) if any(_visible(scene, 0, t) for t in times[2 * k: 2 * k + 2])]
        return (stamps[pairs[0] - 1] if pairs[0] > 0 else 0.0,
                stamps[pairs[-1] + 1] if pairs[-1] + 1 < len(stamps) else scene.duration)
    seen = [t for t in times if _visible(scene, 0, t)]
    before = max([t for t in times if t < seen[0]], default=0.0)
    after = min([t for t in times if t > seen[-1]], default=scene.duration)
    step = 1.0 / task.zoom_fps  # the window on the zoom's frame grid: short numbers
    start = math.floor(before / step + 1e-9) * step
    return start, min(math.ceil(after / step - 1e-9) * step, start + task.zoom_max_frames * step)


SHIFT_MARGIN_S = (0.5, 1.0)  # a shifted window keeps the flash this far inside its start and its end


def shifted_windows(scene: Scene, task: ZoomTask, rng: np.random.Generator, k: int) -> list[tuple[float, float]]:
    """Up to k windows of the rule's length, moved along the video on the zoom's frame grid (no two alike, none the
    rule's own), each holding the flash SHIFT_MARGIN_S inside its ends, so that the clip's written times hold both
    ends of the copied answer. Unlike the rule's window these are drawn knowing the flash (the drawn span): extra
    answer turns for the cold start, each a different clip and different written times to copy from."""
    start, end = rule_window(scene, task)
    step, flash = 1.0 / task.zoom_fps, scene.events[1]
    lo = max(-start, flash.end + SHIFT_MARGIN_S[1] - end)  # the shifts d: the window [start + d, end + d]
    hi = min(scene.duration - end, flash.start - SHIFT_MARGIN_S[0] - start)
    grid = [d * step for d in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1) if d != 0]
    picked = sorted(rng.choice(len(grid), size=min(k, len(grid)), replace=False).tolist()) if grid else []
    return [(round(start + grid[i], 6), round(end + grid[i], 6)) for i in picked]  # 10.7, not 10.700000000000001


def rule_trajectory(scene: Scene, task: ZoomTask, window: tuple[float, float] | None = None) -> dict:
    """The rule-based policy's trajectory for one video: what it sees in the overview frames, its zoom call, the
    clip's window and what it sees there, its answer. Reads only what the frames it is shown hold (`Scene`'s
    drawing rule at the sampled times), never the drawn spans directly; `window` replaces the rule's own window
    (`rule_window`) with another (`shifted_windows`), the rest of the trajectory as the rule writes it.

    The answer is copied from the clip, not computed: its start is the time written before the first pair of frames
    that shows the flash, its end the time written before the pair after the last one that does (the window's end
    when the flash lasts to it), each as the clip writes it. Copying a written time is what a small model can learn
    to do from the trajectories; an answer computed from the frames' times (the pair's first frame, plus the frame
    interval at the end) scores higher against the truth when exact (tIoU about 0.8 against about 0.45) but asks the
    model for arithmetic on the digits it reads, which the toy task's models did not learn (docs/performance.md)."""
    from mmpg.rollout.zoom import call_text

    seen = [t for t in task.overview_times() if _visible(scene, 0, t)]
    start, end = window if window is not None else rule_window(scene, task)
    written = written_times(clip_times(scene, task, start, end))
    shows = flash_pairs(scene, task, start, end)
    think = "<think>The square is there; I look again to find the flash.</think>"
    if any(shows):
        first = shows.index(True)
        last = len(shows) - 1 - shows[::-1].index(True)
        text = (written[first], written[last + 1] if last + 1 < len(written) else f"{end:.1f}")
        final = f"<think>{SEEN}</think><answer>{text[0]} to {text[1]}</answer>"
    else:  # the clip missed it: answer the field, as one look would
        text = (f"{seen[0]:.2f}", f"{seen[-1]:.2f}")
        final = f"<think>{MISSED}</think><answer>{text[0]} to {text[1]}</answer>"
    return {"window": [start, end], "answer": [float(x) for x in text], "messages": [
        {"role": "assistant", "content": think + "\n" + call_text(start, end)},
        {"role": "tool", "content": [{"type": "text", "text": f"Frames from {start:.1f} to {end:.1f} seconds:"},
                                     {"type": "video", "video_start": start, "video_end": end}]},
        {"role": "assistant", "content": final}]}


def write_zoom_dataset(out: Path | str, n: int, seed: int = 0, task: ZoomTask | None = None, *,
                       overwrite: bool = False, test_fraction: float = 0.25, windows: int = 1) -> dict:
    """Write n videos of the task into `out`: videos/*.mp4, train.json and test.json (captions format: duration,
    timestamps, sentences), events.json (what was drawn) and trajectories.jsonl (the rule policy's trajectory of
    each training video, then up to `windows` - 1 more on shifted windows, `shifted_windows`, drawn from their own
    generator so the videos are the seed's whatever `windows` is; their calls, drawn knowing the flash, carry
    `"weight": 0`: not in the loss, so the first turn learns the rule's call alone). Written to a hidden sibling
    first and renamed into place. Returns a summary."""
    from mmpg.toy.videos import _check_out, _move_into_place, _write_json

    task = task or ZoomTask()
    problem = task.problem()
    if problem:
        raise UserError(problem)
    if n < 2:
        raise UserError(f"n={n}: the zoom task needs >= 2 videos (a training and a test split)")
    if windows < 1:
        raise UserError(f"windows={windows}: the zoom task writes >= 1 trajectory per training video")
    out = Path(os.path.abspath(Path(out).expanduser()))
    _check_out(out, overwrite)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "videos").mkdir(parents=True)
        scenes = zoom_scenes(n, seed, task)
        for scene in scenes:
            _encode(tmp / "videos" / f"{scene.video_id}.mp4", scene)
        n_test = max(1, int(round(n * test_fraction)))
        splits = {"train": scenes[:-n_test], "test": scenes[-n_test:]}
        for name, part in splits.items():
            _write_json(tmp / f"{name}.json", {sc.video_id: {
                "duration": sc.duration, "timestamps": [[sc.events[1].start, sc.events[1].end]],
                "sentences": [QUERY]} for sc in part})
        _write_json(tmp / "events.json", {sc.video_id: {
            "field": [sc.events[0].start, sc.events[0].end], "colour": sc.events[0].colour,
            "flash": [sc.events[1].start, sc.events[1].end]} for sc in scenes})
        shifts = np.random.default_rng([seed, 1])
        written = 0
        with open(tmp / "trajectories.jsonl", "w") as f:
            for sc in splits["train"]:
                for window in [None, *shifted_windows(sc, task, shifts, windows - 1)]:
                    trajectory = rule_trajectory(sc, task, window)
                    if window is not None:  # a call drawn knowing the flash: its clip is trained on, not the call
                        trajectory["messages"][0]["weight"] = 0
                    f.write(json.dumps({"video": f"videos/{sc.video_id}.mp4", "query": QUERY,
                                        "span": [sc.events[1].start, sc.events[1].end], **trajectory}) + "\n")
                    written += 1
        out.parent.mkdir(parents=True, exist_ok=True)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"videos": n, "train": len(splits["train"]), "test": len(splits["test"]), "trajectories": written,
            "out": str(out)}


def _encode(path: Path, scene: Scene) -> None:
    planes = render.background_planes(np.zeros((scene.height, scene.width, 3), np.uint8))

    def frames():
        for i in range(scene.n_frames):
            t = i / scene.fps
            yield render.render_frame(planes, [s for s in (e.sprite_at(t) for e in scene.events) if s is not None])

    written = render.encode_video(path, frames(), scene.width, scene.height, scene.fps)
    assert written == scene.n_frames, f"{path}: wrote {written} frames, expected {scene.n_frames}"
