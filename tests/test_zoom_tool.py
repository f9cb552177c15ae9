"""The zoom tool (`mmpg.rollout.zoom`): its calls parsed as the Qwen-VL Instruct checkpoints write them, its windows
checked, its clips decoded from the file at the tool's frame rate, its turns written as the released chat templates
write a tool call and a video-bearing tool response, and turned into the ids and visual inputs the trajectory tree
takes (`completion_visuals`, tests/test_trajectory_tree.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from batches import write_mp4

from mmpg.data.samples import GroundingSample
from mmpg.data.video import VideoSpec, load_video
from mmpg.rollout.zoom import (
    BadCall, ZoomCall, ZoomEnvironment, ZoomSettings, clip_turn, parse_call, tool_schema, turn_inputs, window_problem,
)

REAL = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "real" / "processors"
real = pytest.mark.skipif(not (REAL / "qwen3_vl" / "vocab.json").is_file(),
                          reason="the real processor files (../shared/data/real/processors) are absent")


def call_text(args, name="zoom") -> str:
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": args}) + '\n</tool_call>'


@pytest.mark.parametrize("turn, expected", [
    ("The moment is from 3.0 to 5.5 seconds.", None),
    (call_text({"start": 4, "end": 8.5}), ZoomCall(4.0, 8.5)),
    ("Let me look closer.\n" + call_text({"start": 1.25, "end": 2}), ZoomCall(1.25, 2.0)),
    ('<tool_call>\n{"name": "zoom", "arguments": "{\\"start\\": 1, \\"end\\": 2}"}\n</tool_call>', ZoomCall(1.0, 2.0)),
    ('<tool_call>\n{"name": "zoom", "arguments": {"start": 1, "end": 2}}', BadCall("not closed")),
    (call_text({"start": 1, "end": 2}) + call_text({"start": 3, "end": 4}), BadCall("one zoom call")),
    ("<tool_call>\nzoom(1, 2)\n</tool_call>", BadCall("not JSON")),
    (call_text({"start": 1, "end": 2}, name="search"), BadCall("unknown tool 'search'")),
    (call_text({"start": 1}), BadCall("arguments must be")),
    (call_text({"start": True, "end": 2}), BadCall("arguments must be")),
    (call_text({"start": "1", "end": 2}), BadCall("arguments must be")),
    ('<tool_call>\n{"name": "zoom", "arguments": {"start": NaN, "end": 2}}\n</tool_call>', BadCall("arguments must be")),
])
def test_calls_parsed(turn, expected):
    got = parse_call(turn)
    if isinstance(expected, BadCall):
        assert isinstance(got, BadCall) and expected.reason in got.reason, got
    else:
        assert got == expected


def test_windows_checked():
    settings = ZoomSettings(fps=4.0, max_frames=16)  # at most 4 seconds
    shown = (10.0, 40.0)
    assert window_problem(ZoomCall(12.0, 16.0), shown, settings) is None
    assert "ends before it starts" in window_problem(ZoomCall(16.0, 12.0), shown, settings)
    assert "outside the video (10 to 40 seconds)" in window_problem(ZoomCall(8.0, 11.0), shown, settings)
    assert "outside the video" in window_problem(ZoomCall(38.0, 41.0), shown, settings)
    assert "at most 4 seconds (16 frames at 4 fps)" in window_problem(ZoomCall(12.0, 16.5), shown, settings)
    assert ZoomSettings(fps=0).problem() and ZoomSettings(max_frames=1).problem()
    assert ZoomSettings(max_turns=0).problem() and ZoomSettings().problem() is None


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    """A 20-second 10 fps mp4 whose frame k is painted with k's value, so a frame tells its own index."""
    path = tmp_path_factory.mktemp("zoom") / "count.mp4"
    frames = [np.full((56, 84, 3), (k * 5) % 256, dtype=np.uint8) for k in range(200)]
    return str(write_mp4(path, frames, fps=10))


def test_a_call_returns_the_windows_frames(video):
    spec = VideoSpec.for_family("qwen2_5_vl", fps=0.5, max_frames=8)
    env = ZoomEnvironment(ZoomSettings(fps=4.0, max_frames=16, max_turns=2), spec)
    sample = GroundingSample("v#0", video, 20.0, "q", (5.0, 6.0))
    turn = env.step(sample, "Closer.\n" + call_text({"start": 4, "end": 8}), tool_turns=0)
    assert turn.error is None and turn.window == (4.0, 8.0)
    assert turn.text == clip_turn(4.0, 8.0) and "Frames from 4.0 to 8.0 seconds:" in turn.text
    clip = turn.clip
    assert clip.frames.shape[0] == 16  # 4 seconds at 4 fps
    assert 4.0 - 1e-6 <= clip.timestamps[0] and clip.timestamps[-1] <= 8.0 + 1e-6  # seconds of the file
    # the frames are the file's own in that window: what load_video decodes there at the tool's rate, bit for bit
    same = load_video(video, env.spec, 4.0, 8.0)
    assert torch.equal(clip.frames, same.frames) and clip.timestamps == same.timestamps
    assert env.spec.fps == 4.0 and env.spec.max_frames == 16 and env.spec.image_patch_size == 14


def test_bad_calls_get_error_turns_and_the_turns_run_out(video):
    env = ZoomEnvironment(ZoomSettings(fps=4.0, max_frames=16, max_turns=2), VideoSpec.for_family("qwen3_vl"))
    sample = GroundingSample("v#0", video, 20.0, "q", (5.0, 6.0), clip_start=2.0, clip_end=12.0)
    outside = env.step(sample, call_text({"start": 0, "end": 3}), tool_turns=0)
    assert outside.clip is None and "outside the video (2 to 12 seconds)" in outside.error
    assert "Error: the window [0, 3] is outside the video" in outside.text
    assert "<tool_response>" in env.step(sample, "<tool_call>oops</tool_call>", tool_turns=1).text
    assert env.step(sample, call_text({"start": 3, "end": 4}), tool_turns=2) is None  # max_turns spent: ends
    assert env.step(sample, "From 3 to 4 seconds.", tool_turns=0) is None  # an answer: ends
    with pytest.raises(ValueError, match="zoom.max_frames=1"):
        ZoomEnvironment(ZoomSettings(max_frames=1), VideoSpec())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_tool_turns_ids_and_clip_go_into_the_tree(family, video, load_tiny):
    """The tool turn's ids and clip are what the trajectory tree takes: a branch [call | tool turn | answer] scores
    as the whole conversation forwarded alone."""
    from batches import video_prompts
    from grouping_check import compare

    model, processor = load_tiny(family)
    f2 = VideoSpec.for_family(family).factor ** 2  # small frames: 4 to 6 tokens each
    env = ZoomEnvironment(ZoomSettings(fps=4.0, max_frames=8),
                          VideoSpec.for_family(family, min_pixels=4 * f2, max_pixels=6 * f2))
    sample = GroundingSample("v#0", video, 20.0, "q", (5.0, 6.0))
    turn = env.step(sample, call_text({"start": 4, "end": 6}), tool_turns=0)
    ids, visuals = turn_inputs(processor, turn)
    assert int(visuals["video_grid_thw"][0, 0]) == 4  # 8 frames: 4 temporal patches
    assert int((ids == model.config.video_token_id).sum()) == int(visuals["video_grid_thw"].prod() // 4)
    error_ids, none = turn_inputs(processor, env.step(sample, call_text({"start": 4, "end": 30}), tool_turns=0))
    assert none == {} and not bool((error_ids == model.config.video_token_id).any())
    tok = processor.tokenizer
    call = tok(call_text({"start": 4, "end": 6}), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    answer = tok("From 5.0 to 6.0 seconds.", add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    rows = [torch.cat([call, ids, answer]), torch.cat([call, error_ids, answer]), answer]
    width = max(len(r) for r in rows)
    completion = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    inputs = video_prompts(processor, [0], "left")
    compare(model, inputs, completion, mask, [3], completion_visuals=[visuals, {}, {}])


@real
def test_the_released_qwen3_vl_template_writes_the_same_conversation():
    """Qwen3-VL's chat template, given the tool, the model's call and a tool message holding the clip, renders what
    the prompt, the model's turn and `clip_turn` make together."""
    from mmpg.models.loading import load_processor

    processor = load_processor(REAL / "qwen3_vl")
    user = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "When does the cat jump?"}]}
    prompt = processor.apply_chat_template([user], tools=[tool_schema()], tokenize=False, add_generation_prompt=True)
    assistant = {"role": "assistant", "content": "Let me look closer.",
                 "tool_calls": [{"function": {"name": "zoom", "arguments": {"start": 4.0, "end": 8.0}}}]}
    tool = {"role": "tool", "content": [{"type": "text", "text": "Frames from 4.0 to 8.0 seconds:"},
                                        {"type": "video"}]}
    whole = processor.apply_chat_template([user, assistant, tool], tools=[tool_schema()], tokenize=False,
                                          add_generation_prompt=True)
    model_turn = "Let me look closer.\n" + call_text({"start": 4.0, "end": 8.0}) + "<|im_end|>"
    assert whole == prompt + model_turn + clip_turn(4.0, 8.0)
    assert parse_call(model_turn) == ZoomCall(4.0, 8.0)


@real
def test_the_released_qwen25_tokenizer_template_writes_the_same_tool_turn():
    """Qwen2.5-VL's processor template has no tools; its tokenizer's (Qwen2.5's Hermes template) writes a tool
    response as a user turn holding <tool_response>, the turn `clip_turn` writes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REAL / "qwen2_5_vl")
    user = {"role": "user", "content": "When does the cat jump?"}
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "zoom", "arguments": {"start": 4.0, "end": 8.0}}}]}
    body = "Frames from 4.0 to 8.0 seconds:<|vision_start|><|video_pad|><|vision_end|>"
    tool = {"role": "tool", "content": body}
    prompt = tok.apply_chat_template([user], tools=[tool_schema()], tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template([user, assistant, tool], tools=[tool_schema()], tokenize=False,
                                    add_generation_prompt=True)
    assert whole == prompt + call_text({"start": 4.0, "end": 8.0}) + "<|im_end|>" + clip_turn(4.0, 8.0)


@real
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_zoom_template_writes_the_released_tools_prompt(family):
    """The `zoom` prompt template offers the tool in the system turn exactly as the families' released templates
    write `tools=`: Qwen3-VL's processor template itself, Qwen2.5-VL's tokenizer template (its processor template
    has no tools; its default system text goes before them)."""
    from transformers import AutoTokenizer

    from mmpg.data.prompts import build_messages, get_template
    from mmpg.data.samples import GroundingSample
    from mmpg.models.loading import load_processor

    processor = load_processor(REAL / family)
    sample = GroundingSample("s", "v.mp4", 30.0, "the cat jumps", (1.0, 2.0))
    template = get_template("zoom")
    ours = processor.apply_chat_template(build_messages(sample, None, template, processor), tokenize=False,
                                         add_generation_prompt=True)
    text = template.render(sample)
    if family == "qwen3_vl":
        user = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}
        released = processor.apply_chat_template([user], tools=[tool_schema()], tokenize=False,
                                                 add_generation_prompt=True)
    else:
        tok = AutoTokenizer.from_pretrained(REAL / family)
        user = {"role": "user", "content": "<|vision_start|><|video_pad|><|vision_end|>" + text}
        released = tok.apply_chat_template([user], tools=[tool_schema()], tokenize=False, add_generation_prompt=True)
    assert ours == released
    assert '"name": "zoom"' in ours and ours.count("<|im_start|>system") == 1
