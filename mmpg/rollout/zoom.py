"""The zoom tool of multi-turn grounding: after watching an overview of the video, the model may ask to watch a
window [start, end] again at a higher frame rate, and gets that window's frames as the next turn.

The call is the tool-call form Qwen2.5-VL and Qwen3-VL Instruct checkpoints already write (their chat templates'
tool instructions, Hermes style), one per turn, at the end of the model's turn:

    <tool_call>
    {"name": "zoom", "arguments": {"start": 12.5, "end": 18.0}}
    </tool_call><|im_end|>

chosen over a tag of our own because a released checkpoint needs no new habit for it and Qwen3-VL's chat template
renders the whole conversation, tools, calls and video-bearing tool turns, as this module writes it (the tests
compare both on the released template). The tool's answer is a user turn holding a `<tool_response>`, as both
families' templates write one:

    \\n<|im_start|>user\\n<tool_response>\\nFrames from 12.5 to 18.0 seconds:<video>\\n</tool_response><|im_end|>
    \\n<|im_start|>assistant\\n

Times are seconds of the whole video file, the axis of the prompt's question and of the answer (`mmpg.data.samples`);
the clip is decoded from the file at `fps` up to `max_frames` frames, as qwen-vl-utils samples any video, and its
frames' times are in its metadata: Qwen3-VL's processor writes each frame's time as text before it, so the model
reads where the clip lies; Qwen2.5-VL reads it from the turn's first words. A malformed call, a window outside the
shown video or longer than `max_frames / fps` seconds gets a short error turn instead (the model may try again);
after `max_turns` tool turns a further call ends the trajectory unanswered.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

TOOL_NAME = "zoom"
VIDEO_TEXT = "<|vision_start|><|video_pad|><|vision_end|>"  # the chat templates' video placeholder
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n{body}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def tool_schema() -> dict:
    """The zoom tool as a chat template's `tools=` takes it (the OpenAI function format)."""
    return {"type": "function", "function": {
        "name": TOOL_NAME,
        "description": "Watch a window of the video again at a higher frame rate. Times are in seconds.",
        "parameters": {"type": "object", "properties": {
            "start": {"type": "number", "description": "start of the window, in seconds"},
            "end": {"type": "number", "description": "end of the window, in seconds"}},
            "required": ["start", "end"]}}}


@dataclasses.dataclass(frozen=True)
class ZoomSettings:
    """What the tool returns: a window's frames at `fps`, at most `max_frames` of them (so windows of at most
    max_frames / fps seconds), and at most `max_turns` tool turns per trajectory."""

    fps: float = 4.0
    max_frames: int = 16
    max_turns: int = 2

    def problem(self) -> str | None:
        """Why these settings cannot work (naming the field), None when they can."""
        if not (self.fps > 0 and math.isfinite(self.fps)):
            return f"zoom.fps={self.fps}: must be a positive number of frames per second"
        if self.max_frames < 2:
            return f"zoom.max_frames={self.max_frames}: a clip needs >= 2 frames (two frames make one temporal patch)"
        if self.max_turns < 1:
            return f"zoom.max_turns={self.max_turns}: must be >= 1 (no zoom at all: leave the tool off)"
        return None

    @property
    def max_window_s(self) -> float:
        return self.max_frames / self.fps


@dataclasses.dataclass(frozen=True)
class ZoomCall:
    """A well-formed call: the window [start, end] in seconds of the video file."""

    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class BadCall:
    """A call the tool cannot run; `reason` is what the error turn tells the model."""

    reason: str


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def parse_call(turn: str) -> ZoomCall | BadCall | None:
    """The model's turn (decoded text) -> its zoom call, a BadCall (malformed), or None: no call, the turn answers."""
    if "<tool_call>" not in turn:
        return None
    calls = _CALL.findall(turn)
    if not calls:
        return BadCall("the <tool_call> is not closed with </tool_call>")
    if len(calls) > 1:
        return BadCall("one zoom call per turn")
    try:
        call = json.loads(calls[0].strip())
    except json.JSONDecodeError:
        return BadCall('the call is not JSON: write {"name": "zoom", "arguments": {"start": S, "end": E}}')
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
        name = call.get("name") if isinstance(call, dict) else None
        return BadCall(f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}")
    args = call.get("arguments")
    if isinstance(args, str):  # some checkpoints write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict):
        return BadCall('the arguments must be {"start": S, "end": E} in seconds')
    start, end = _number(args.get("start")), _number(args.get("end"))
    if start is None or end is None:
        return BadCall('the arguments must be {"start": S, "end": E} in seconds')
    return ZoomCall(start, end)


def window_problem(call: ZoomCall, shown: tuple[float, float], settings: ZoomSettings) -> str | None:
    """Why the tool cannot return this window of the shown video [lo, hi] (seconds of the file), None if it can."""
    lo, hi = shown
    if call.end <= call.start:
        return f"the window [{call.start:g}, {call.end:g}] ends before it starts"
    if call.start < lo - 1e-6 or call.end > hi + 1e-6:
        return f"the window [{call.start:g}, {call.end:g}] is outside the video ({lo:g} to {hi:g} seconds)"
    if call.end - call.start > settings.max_window_s + 1e-6:
        return (f"the window [{call.start:g}, {call.end:g}] is {call.end - call.start:g} seconds; zoom shows at most "
                f"{settings.max_window_s:g} seconds ({settings.max_frames} frames at {settings.fps:g} fps)")
    return None


@dataclasses.dataclass
class ToolTurn:
    """What the environment appends to a branch after the model's turn: `text` (the chat-template text of the
    tool turn, the clip as the template's video placeholder) and the clip's frames, or an error turn (`error`, no
    clip). `window`: the window shown, seconds of the file."""

    text: str
    window: tuple[float, float] | None = None
    clip: object | None = None  # mmpg.data.video.DecodedVideo (a sampled trajectory's: None, released once sampled)
    error: str | None = None
    frames: int = 0  # the clip's frame count
    tokens: int = 0  # the turn's token count, clip included (set where it is tokenized for a rollout)


def trajectory_turns(turns: list[str], tools: list[ToolTurn]) -> list[dict]:
    """One trajectory as the run's records write it: the model's turns {"model": text} and, after each but the
    last, the tool's {"zoom": [start_s, end_s], "frames": n} (a clip of n frames) or {"error": reason}."""
    out = []
    for k, text in enumerate(turns):
        out.append({"model": text})
        if k < len(tools):
            tool = tools[k]
            out.append({"zoom": list(tool.window), "frames": tool.frames}
                       if tool.window is not None else {"error": tool.error})
    return out


def call_text(start: float, end: float) -> str:
    """A zoom call on [start, end] as the model writes it (module docstring): what rule-based trajectories write."""
    return "<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {"start": start, "end": end}}) + \
        "\n</tool_call>"


def clip_turn(start: float, end: float) -> str:
    return TOOL_TURN.format(body=f"Frames from {start:.1f} to {end:.1f} seconds:{VIDEO_TEXT}")


def error_turn(reason: str) -> str:
    return TOOL_TURN.format(body=f"Error: {reason}.")


class ZoomEnvironment:
    """The tool's side of a trajectory, one branch at a time: `step` reads the model's latest turn and says what
    comes next (a tool turn, or None: the trajectory is over). `decode(path, spec, start, end)`: the video loader
    (`mmpg.data.video.load_video`; a frame cache's loader where one is on); `spec`: the overview's VideoSpec, whose
    pixel settings the clip keeps (its frame rate and count are the tool's)."""

    def __init__(self, settings: ZoomSettings, spec, decode=None):
        problem = settings.problem()
        if problem:
            raise ValueError(problem)
        from mmpg.data.video import load_video

        self.settings = settings
        self.spec = dataclasses.replace(spec, fps=settings.fps, min_frames=2, max_frames=settings.max_frames)
        self.decode = decode or load_video

    def shown(self, sample) -> tuple[float, float]:
        """The part of the file the overview shows, in seconds of the file."""
        lo = sample.clip_start or 0.0
        hi = sample.clip_end if sample.clip_end is not None else sample.duration
        if hi is None:  # a sample whose duration was not filled in: the file says it
            from mmpg.data.video import read_duration

            hi = read_duration(sample.video)
        return lo, hi

    def step(self, sample, turn: str, tool_turns: int) -> ToolTurn | None:
        """The model's `turn` (decoded text) after `tool_turns` tool turns -> the next tool turn, or None when the
        turn has no call (it answers) or the tool turns are spent (`max_turns`: the trajectory ends there)."""
        call = parse_call(turn)
        if call is None or tool_turns >= self.settings.max_turns:
            return None
        if isinstance(call, BadCall):
            return ToolTurn(error_turn(call.reason), error=call.reason)
        problem = window_problem(call, self.shown(sample), self.settings)
        if problem:
            return ToolTurn(error_turn(problem), error=problem)
        clip = self.decode(sample.video, self.spec, call.start, call.end)
        return ToolTurn(clip_turn(call.start, call.end), window=(call.start, call.end), clip=clip,
                        frames=int(clip.frames.shape[0]))


def turn_inputs(processor, turn: ToolTurn):
    """A tool turn as the model reads it: (its token ids [L], its clip's visual inputs, {} for an error turn), from
    the model's processor (Qwen3-VL's video in the released form, `mmpg.data.video_form`)."""
    from mmpg.data.video_form import check_released_form, released_video_text

    text = released_video_text(processor, turn.text)
    if turn.clip is None:
        return processor.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0], {}
    vp = processor.video_processor
    extra = {"cap_pixels_per_frame": True} if hasattr(vp, "cap_pixels_per_frame") else {}
    out = processor(text=[text], videos=[turn.clip.frames], video_metadata=[dict(turn.clip.metadata)],
                    do_sample_frames=False, do_resize=False, return_tensors="pt", **extra)
    check_released_form(processor, out["input_ids"])
    visuals = {k: out[k] for k in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts") if k in out}
    return out["input_ids"][0], visuals
