"""Prompt templates and the step from (sample, decoded frames) to processor inputs.

A template is a user text with placeholders, an optional system prompt, and whether it asks for `<think>`:

    {query}        the sentence to ground
    {duration}     seconds of the video, two decimals ("30.96")
    {window}       "" for the whole video, or " (this clip shows seconds 10.00 to 40.00 of it)"
    {num_frames}   frames the model sees
    {frame_times}  the sampled times, "0.00, 0.50, 1.00, ..." (seconds)

The default follows Time-R1 (arXiv 2503.13377): reason in `<think>...</think>`, then `<answer>START to END</answer>`
in seconds, always of the whole video, also when a clip window is shown. The chat template belongs to the model
family's processor (Qwen chat messages rendered with `processor.apply_chat_template`). Frames go to the processor as
qwen-vl-utils decoded them (`do_resize=False`, `do_sample_frames=False`) with their `video_metadata`, from which
Qwen2.5-VL derives `second_per_grid_ts` and Qwen3-VL its `<t seconds>` timestamps; Qwen3-VL's video goes in the form
that makes its processor write the released prompt on every transformers version (`mmpg.data.video_form`).
"""

from __future__ import annotations

import dataclasses
import json
import string
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from transformers import BatchFeature

from mmpg.data.queries import QUERY_CLEANINGS, sample_query
from mmpg.data.samples import GroundingSample
from mmpg.data.video import DecodedVideo, VideoPart
from mmpg.data.video_form import check_released_form, released_video_text
from mmpg.errors import UserError
from mmpg.grouping.inputs import VIDEO_PART

PLACEHOLDERS = ("query", "duration", "window", "num_frames", "frame_times")

_ANSWER_RULE = ('give the start and end times of the moment in seconds, with up to two decimals, as "START to END" '
                'within <answer> </answer> tags, for example <answer>12.54 to 17.83</answer>.')


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """A user prompt with placeholders (see the module docstring), an optional system prompt."""

    user: str
    """The user text; placeholders {query} {duration} {window} {num_frames} {frame_times}."""
    system: str | None = None
    """System prompt, or None to leave the family's default (Qwen2.5-VL adds its own; Qwen3-VL none)."""
    think: bool = True
    """Whether the template asks for <think>...</think> before <answer> (the format reward checks the same)."""
    query_clean: str = "mmpg"
    """How {query} is cleaned (`mmpg.data.queries`): mmpg (trailing periods dropped), or a paper's rule."""
    tools: tuple[str, ...] = ()
    """The tools the prompt offers the model (`zoom`: `mmpg.rollout.zoom`), written into the system turn as the
    families' chat templates write tools (`tools_system`); a template with tools makes rollouts multi-turn."""
    list_tools: bool = True
    """False leaves the tools' block out of the system turn: the prompt's text still asks for the tool and the
    trajectories stay multi-turn, but the schema is not listed (`sft.list_tools`: a cold start's first steps for a
    model trained from random, docs/performance.md)."""

    def __post_init__(self):
        if self.query_clean not in QUERY_CLEANINGS:
            raise UserError(f"query_clean {self.query_clean!r}: choose one of {', '.join(QUERY_CLEANINGS)}")
        for text in (self.user, self.system or ""):
            for _, field, _, _ in string.Formatter().parse(text):
                if field is not None and field not in PLACEHOLDERS:
                    raise UserError(f"prompt template uses unknown placeholder {{{field}}}; use only "
                                    + " ".join("{%s}" % p for p in PLACEHOLDERS) + " (double braces for literal ones)")

    def fields(self, sample: GroundingSample, video: DecodedVideo | None = None) -> dict[str, Any]:
        duration = sample.duration if sample.duration is not None else (video.duration if video else None)
        window = ""
        if sample.clip_start is not None or sample.clip_end is not None:
            lo = sample.clip_start or 0.0
            hi = sample.clip_end if sample.clip_end is not None else duration
            window = f" (this clip shows seconds {lo:.2f} to {hi:.2f} of it)" if hi is not None else ""
        return {
            "query": sample_query(sample, self.query_clean),
            "duration": f"{duration:.2f}" if duration is not None else "unknown",
            "window": window,
            "num_frames": len(video.timestamps) if video else "",
            "frame_times": ", ".join(f"{t:.2f}" for t in video.timestamps) if video else "",
        }

    def render(self, sample: GroundingSample, video: DecodedVideo | None = None) -> str:
        return self.user.format(**self.fields(sample, video))

    def render_system(self, sample: GroundingSample, video: DecodedVideo | None = None) -> str | None:
        return self.system.format(**self.fields(sample, video)) if self.system else None


TEMPLATES: dict[str, PromptTemplate] = {
    "time_r1": PromptTemplate(
        'The video lasts {duration} seconds{window}. To find the moment described by "{query}", determine the '
        "precise time period of the event in the video. First output your reasoning within <think> </think> tags, "
        "then " + _ANSWER_RULE),
    "time_r1_frames": PromptTemplate(
        "The video lasts {duration} seconds{window}; its {num_frames} frames were taken at these times (seconds): "
        '{frame_times}. To find the moment described by "{query}", determine the precise time period of the event '
        "in the video. First output your reasoning within <think> </think> tags, then " + _ANSWER_RULE),
    "answer_only": PromptTemplate(
        'The video lasts {duration} seconds{window}. Find the moment described by "{query}" and ' + _ANSWER_RULE,
        think=False),
    "zoom": PromptTemplate(
        'The video lasts {duration} seconds{window}; you see it at a low frame rate. To find the moment described '
        'by "{query}", you may call the zoom tool to watch a window of the video again at a higher frame rate, one '
        "call per turn. First output your reasoning within <think> </think> tags, then either call the tool or "
        + _ANSWER_RULE, tools=("zoom",)),
}
DEFAULT_TEMPLATE = TEMPLATES["time_r1"]


def get_template(template: str | PromptTemplate | None) -> PromptTemplate:
    """A template by name (`time_r1`, `time_r1_frames`, `answer_only`), a template object, or the default."""
    if template is None:
        return DEFAULT_TEMPLATE
    if isinstance(template, PromptTemplate):
        return template
    if template not in TEMPLATES:
        raise UserError(f"unknown prompt template {template!r}; choose one of {', '.join(TEMPLATES)} "
                        "or give a PromptTemplate")
    return TEMPLATES[template]


_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
               "with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


def tool_schemas(names: Sequence[str]) -> list[dict]:
    """The chat-template schemas (OpenAI function format) of the named tools."""
    from mmpg.rollout.zoom import TOOL_NAME, tool_schema

    unknown = [n for n in names if n != TOOL_NAME]
    if unknown:
        raise UserError(f"unknown tool {unknown[0]!r}; mmpg's tools: {TOOL_NAME}")
    return [tool_schema() for _ in names]


def default_system(processor) -> str | None:
    """The system text the processor's chat template adds to a conversation without a system turn (Qwen2.5-VL's
    "You are a helpful assistant."), None where it adds none (Qwen3-VL)."""
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                         tokenize=False, add_generation_prompt=False)
    head = "<|im_start|>system\n"
    return text[len(head):text.index("<|im_end|>")] if text.startswith(head) else None


def tools_system(tools: Sequence[str], system: str | None) -> str:
    """The system turn's text offering `tools`, as both families' released chat templates write it when given
    `tools=` (Hermes style): the system text (the template's or the family's default), a blank line, then the tools'
    signatures and the call form. The processor's own template then renders it as any system turn, so every
    family's processor (also one whose chat template takes no tools) writes the released prompt."""
    block = _TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tool_schemas(tools)) + _TOOLS_TAIL
    return f"{system}\n\n{block}" if system else block


def build_messages(sample: GroundingSample, video: DecodedVideo | None = None,
                   template: str | PromptTemplate | None = None, processor=None) -> list[dict]:
    """Qwen chat messages for one sample: optional system turn, then a user turn with the video and the text. A
    template with tools needs the `processor` (its default system text goes before the tools, `tools_system`)."""
    template = get_template(template)
    messages: list[dict] = []
    system = template.render_system(sample, video)
    if template.tools and template.list_tools:
        if processor is None:
            raise ValueError("a template with tools needs the processor to write its system turn")
        system = tools_system(template.tools, system or default_system(processor))
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": [
        {"type": "video", "video": video.path if video else sample.video},
        {"type": "text", "text": template.render(sample, video)},
    ]})
    return messages


def build_prompt_inputs(processor, samples: Sequence[GroundingSample], videos: Sequence[DecodedVideo],
                        template: str | PromptTemplate | None = None, padding_side: str = "left"):
    """Processor inputs for B prompts (one video each), left padded by default.

    Returns the processor's BatchFeature: input_ids / attention_mask [B, P], pixel_values_videos
    [sum_b T_b*H_b*W_b / patch^2, C*2*patch^2], video_grid_thw [B, 3], mm_token_type_ids [B, P], and for
    Qwen2.5-VL second_per_grid_ts [B].
    """
    if len(samples) != len(videos):
        raise ValueError(f"{len(samples)} samples but {len(videos)} videos")
    vp = processor.video_processor
    factor = vp.patch_size * vp.merge_size
    for sample, video in zip(samples, videos):
        h, w = video.frames.shape[-2:]
        if h % factor or w % factor:
            raise UserError(f"{sample.where}: frames are {h}x{w}, not multiples of {factor} for this processor; "
                            "decode with VideoSpec.for_family(<the model family>)")
    texts = [released_video_text(processor, processor.apply_chat_template(
        build_messages(s, v, template, processor), tokenize=False, add_generation_prompt=True))
        for s, v in zip(samples, videos)]
    # Frames are already sized by qwen-vl-utils, so the processor's own per-frame pixel cap (a transformers 5.x
    # option that warns when unset) has nothing to do; set it only where it exists.
    extra = {"cap_pixels_per_frame": True} if hasattr(vp, "cap_pixels_per_frame") else {}
    parts = [v for v in videos if isinstance(v, VideoPart) and v.sp > 1]
    if parts:
        if len(parts) != len(videos) or len({(v.rank, v.sp) for v in parts}) != 1:
            raise ValueError("a batch's videos are all one sequence-parallel rank's parts, or all whole")
        return _part_inputs(processor, texts, parts, padding_side, extra)
    videos = [v.as_video() if isinstance(v, VideoPart) else v for v in videos]
    inputs = processor(text=texts, videos=[v.frames for v in videos],
                       video_metadata=[dict(v.metadata) for v in videos], do_sample_frames=False, do_resize=False,
                       padding=True, padding_side=padding_side, return_tensors="pt", **extra)
    check_released_form(processor, inputs["input_ids"])
    return inputs


_ROW_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")  # the [B, P] outputs of a Qwen-VL processor


def _part_inputs(processor, texts: list[str], parts: Sequence[VideoPart], padding_side: str, extra: dict):
    """The processor inputs of the whole videos' prompts with only this rank's pixel rows (`VideoPart`s).

    The prompt text of a video depends on its grid (t, h, w) and metadata only, never on its pixels: the processor is
    run on stand-ins of the same frame count and metadata at one merged patch a frame (one placeholder per temporal
    patch: Qwen2.5-VL writes t of them in a run, Qwen3-VL one per `<t seconds>` block), and each placeholder is then
    repeated h w / merge^2 times, the number the whole frames give it. The pixel rows are the video processor's on the
    part's frames: its rows are ordered by temporal patch and normalised per pixel, so they equal the whole video's
    rows of groups [a, b) (tests/test_video_parts.py). `VIDEO_PART` marks every video (rank, sp)."""
    vp = processor.video_processor
    factor, merge = vp.patch_size * vp.merge_size, vp.merge_size
    stand_ins = [torch.zeros(v.whole_frames, v.frames.shape[1], factor, factor) for v in parts]
    small = processor(text=texts, videos=stand_ins, video_metadata=[dict(v.metadata) for v in parts],
                      do_sample_frames=False, do_resize=False, padding=True, padding_side=padding_side,
                      return_tensors="pt", **extra)
    shape = small["input_ids"].shape
    unknown = [k for k, v in small.items() if torch.is_tensor(v) and v.shape == shape and k not in _ROW_KEYS]
    if unknown:
        raise RuntimeError(f"the processor returned per-token outputs {unknown} that a video decoded per rank cannot "
                           "rebuild; set parallel.sequence_parallel_size=1 or use a supported transformers release")
    tok = getattr(processor, "tokenizer", processor)
    video_id = tok.convert_tokens_to_ids(processor.video_token)
    attn = small["attention_mask"].bool()
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in _ROW_KEYS if small.get(k) is not None}
    grids = []
    for b, v in enumerate(parts):
        h, w = (int(x) // vp.patch_size for x in v.frames.shape[-2:])
        grid = small["video_grid_thw"][b].tolist()
        if grid[1:] != [merge, merge]:
            raise RuntimeError(f"{v.path}: the stand-in video's grid is {grid}, expected [t, {merge}, {merge}]")
        grids.append([grid[0], h, w])
        ids = small["input_ids"][b][attn[b]]
        repeat = torch.where(ids == video_id, h * w // merge ** 2, 1)
        for key in rows:
            rows[key].append(small[key][b][attn[b]].repeat_interleave(repeat))
    width = max(r.numel() for r in rows["input_ids"])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def padded(r: torch.Tensor, value: int) -> torch.Tensor:
        gap = width - r.numel()
        return F.pad(r, (gap, 0) if padding_side == "left" else (0, gap), value=value)

    data = {key: torch.stack([padded(r, pad_id if key == "input_ids" else 0) for r in rows[key]]) for key in rows}
    data["video_grid_thw"] = torch.tensor(grids, dtype=small["video_grid_thw"].dtype)
    for key in ("second_per_grid_ts",):
        if small.get(key) is not None:
            data[key] = small[key]
    held = [v for v in parts if v.frames.shape[0] > 0]
    if held:
        data["pixel_values_videos"] = vp(videos=[v.frames for v in held], do_sample_frames=False, do_resize=False,
                                         return_tensors="pt", **extra)["pixel_values_videos"]
    else:  # every video's part is empty here (fewer temporal patches than ranks)
        c = parts[0].frames.shape[1]
        data["pixel_values_videos"] = torch.zeros(0, c * vp.temporal_patch_size * vp.patch_size ** 2)
    data[VIDEO_PART] = torch.tensor([[v.rank, v.sp] for v in parts])
    check_released_form(processor, data["input_ids"])
    return BatchFeature(data=data)

