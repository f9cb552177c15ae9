"""Multi-turn SFT trajectories with the zoom tool (the cold start of glance and zoom), read and checked.

A trajectories file is JSON Lines, one trajectory a line (what `mmpg synth --zoom` writes as trajectories.jsonl):

    {"video": "videos/x.mp4", "query": "...", "span": [s, e], "messages": [
        {"role": "assistant", "content": "<think>...</think>\\n<tool_call>{... zoom ...}</tool_call>"},
        {"role": "tool", "content": [{"type": "text", "text": "..."}, {"type": "video", "video_start": a,
                                                                          "video_end": b}]},
        {"role": "assistant", "content": "<think>...</think><answer>s to e</answer>"}]}

A model turn may carry `"weight": 0` (as in OpenAI's chat fine-tuning format; 1 is the default): it stays in the
conversation the model is trained on but is not in the loss, e.g. a call written for its clip, not to be imitated
(`mmpg synth --zoom --zoom-windows N` marks so the calls of its shifted windows). A trajectory trains at least one turn.

The messages are the model's turns and the tool's, alternating, from the model's first turn to its answer: every
model turn but the last calls the zoom tool once (`mmpg.rollout.zoom.parse_call`), the tool turn after it holds that
window's clip, and the last turn answers without a call. What the chat templates cannot express, or the tool would
not have returned, is refused before anything trains, one line naming the file, the line and the message: a tool turn
with an image or anything but text and one video, a clip whose window is not the call's, a call the tool cannot
parse, a final turn that calls, messages out of order. The tool turn's text is the tool's own (`clip_turn`) when
training writes the conversation; the file's text is for people reading it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mmpg.data.samples import GroundingSample
from mmpg.errors import UserError
from mmpg.rollout.zoom import BadCall, ZoomCall, parse_call

KEYS = ("video", "query", "span", "messages")


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One checked trajectory: its sample (video, query, the truth), the model's turns in order and the window of
    each tool turn between them (len(turns) == len(windows) + 1), and whether each model turn is in the loss
    (`weights`, 1 or 0: the message's `weight`)."""

    sample: GroundingSample
    turns: tuple[str, ...]
    windows: tuple[tuple[float, float], ...]
    weights: tuple[int, ...]


def _tool_window(content, where: str) -> tuple[float, float]:
    if not isinstance(content, list):
        raise UserError(f"{where}: a tool turn's content must be a list of parts (text, and the clip as a video)")
    videos = [p for p in content if isinstance(p, dict) and (p.get("type") == "video" or "video_start" in p)]
    others = [p for p in content if p not in videos and not (isinstance(p, dict) and p.get("type") == "text")]
    if others:
        kind = others[0].get("type") if isinstance(others[0], dict) else type(others[0]).__name__
        raise UserError(f"{where}: a tool turn holds text and one video clip; the zoom tool returns no {kind!r}")
    if len(videos) != 1:
        raise UserError(f"{where}: a tool turn holds exactly one video clip, this one {len(videos)}")
    start, end = videos[0].get("video_start"), videos[0].get("video_end")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (start, end)):
        raise UserError(f"{where}: the clip needs numeric video_start and video_end (seconds of the file)")
    return float(start), float(end)


def parse_trajectory(record, where: str, videos: Path | None = None) -> Trajectory:
    """One line's record -> a Trajectory, or a UserError naming `where` (file:line) and the message."""
    if not isinstance(record, dict) or any(k not in record for k in KEYS):
        raise UserError(f"{where}: a trajectory needs the keys {', '.join(KEYS)}")
    span = record["span"]
    if not (isinstance(span, list) and len(span) == 2 and all(isinstance(x, (int, float)) for x in span)
            and span[0] < span[1]):
        raise UserError(f"{where}: span must be [start, end] in seconds, start < end; got {span!r}")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages or len(messages) % 2 == 0:
        raise UserError(f"{where}: messages must alternate assistant and tool turns, from the model's first turn to "
                        "its answer (an odd count)")
    turns, windows, weights = [], [], []
    for k, message in enumerate(messages):
        role = "assistant" if k % 2 == 0 else "tool"
        at = f"{where}: message {k}"
        if not isinstance(message, dict) or message.get("role") != role:
            got = message.get("role") if isinstance(message, dict) else type(message).__name__
            raise UserError(f"{at}: expected a {role} turn, got {got!r} (assistant and tool turns alternate)")
        if role == "tool":
            window = _tool_window(message.get("content"), at)
            if abs(window[0] - windows[-1][0]) > 1e-6 or abs(window[1] - windows[-1][1]) > 1e-6:
                raise UserError(f"{at}: the clip is [{window[0]:g}, {window[1]:g}] but the call asked for "
                                f"[{windows[-1][0]:g}, {windows[-1][1]:g}]")
            continue
        content = message.get("content")
        if not isinstance(content, str):
            raise UserError(f"{at}: a model turn's content must be its text")
        weight = message.get("weight", 1)
        if isinstance(weight, bool) or weight not in (0, 1):
            raise UserError(f"{at}: weight must be 0 (not in the loss) or 1 (the default), got {weight!r}")
        weights.append(int(weight))
        call = parse_call(content)
        last = k == len(messages) - 1
        if last and call is not None:
            raise UserError(f"{at}: the last model turn calls the tool; a trajectory ends with the answer")
        if not last and not isinstance(call, ZoomCall):
            why = call.reason if isinstance(call, BadCall) else "it calls no tool"
            raise UserError(f"{at}: a tool turn follows, but the call cannot be run: {why}")
        if not last:
            windows.append((call.start, call.end))
        turns.append(content)
    if not any(weights):
        raise UserError(f"{where}: every model turn has weight 0: nothing to train on")
    video = Path(str(record["video"]))
    if videos is not None and not video.is_absolute():
        video = videos / video
    sample = GroundingSample(sample_id=f"{Path(where.rsplit(':', 1)[0]).stem}#{where.rsplit(':', 1)[1]}",
                             video=str(video), duration=None, query=str(record["query"]),
                             span=(float(span[0]), float(span[1])), origin=where)
    return Trajectory(sample, tuple(turns), tuple(windows), tuple(weights))


def load_trajectories(path: str | Path, videos: str | Path | None = None) -> list[Trajectory]:
    """Every trajectory of a JSON Lines file, checked (module docstring); relative video paths are under `videos`
    (default: the file's folder). The first problem is a UserError naming the file and line; blank lines are
    skipped."""
    path = Path(path)
    root = Path(videos) if videos is not None else path.parent
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read the trajectories ({e.strerror or e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
        out.append(parse_trajectory(record, f"{path}:{n}", root))
    if not out:
        raise UserError(f"{path}: no trajectories")
    return out


def trajectory_completion(processor, trajectory: Trajectory, env, stop_id: int):
    """The trajectory's completion as training forwards it, the same conversation multi-turn sampling writes
    (`mmpg.rollout.multiturn`): each model turn's tokens and `stop_id`, then the tool's turn for its call (the
    environment's own text and the clip it decodes, `mmpg.rollout.zoom`). -> (ids [L] long, own [L] long: 1 on the
    model's tokens of a turn of weight 1, what the loss covers; the clips' visual inputs, {} without). `env`: a
    `ZoomEnvironment`; a call it refuses (a window outside the video or longer than it shows) is a UserError naming
    the line."""
    import torch

    from mmpg.data.video import read_duration
    from mmpg.grouping.inputs import merge_visuals
    from mmpg.rollout.zoom import turn_inputs

    sample = trajectory.sample
    if sample.duration is None:
        sample = dataclasses.replace(sample, duration=read_duration(sample.video))
    tokenizer = getattr(processor, "tokenizer", processor)
    ids, own, clips = [], [], []
    for k, turn in enumerate(trajectory.turns):
        tokens = tokenizer(turn, add_special_tokens=False)["input_ids"] + [int(stop_id)]
        ids.append(torch.tensor(tokens, dtype=torch.long))
        own.append(torch.full((len(tokens),), trajectory.weights[k], dtype=torch.long))
        if k == len(trajectory.windows):
            break
        tool = env.step(sample, turn, k)
        if tool is None or tool.clip is None:
            why = tool.error if tool is not None else f"the tool allows {env.settings.max_turns} turn(s)"
            raise UserError(f"{sample.origin}: the zoom tool refuses the call of message {2 * k}: {why}")
        tool_ids, visuals = turn_inputs(processor, tool)
        ids.append(tool_ids)
        own.append(torch.zeros(tool_ids.numel(), dtype=torch.long))
        clips.append(visuals)
    return torch.cat(ids), torch.cat(own), (merge_visuals(clips) if clips else {})
