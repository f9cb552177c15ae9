"""Multi-turn SFT trajectories (`mmpg.sft.trajectories`): the zoom task's rule trajectories load as written, and
what the chat templates cannot express or the tool would not have returned is one line naming the file, the line
and the message."""

from __future__ import annotations

import json

import pytest
import torch

from mmpg.errors import UserError
from mmpg.sft.trajectories import load_trajectories
from mmpg.toy.zoom_task import ZoomTask, write_zoom_dataset

CALL = '<tool_call>\n{"name": "zoom", "arguments": {"start": 4.0, "end": 8.0}}\n</tool_call>'
TOOL = {"role": "tool", "content": [{"type": "text", "text": "Frames from 4.0 to 8.0 seconds:"},
                                    {"type": "video", "video_start": 4.0, "video_end": 8.0}]}
ANSWER = {"role": "assistant", "content": "<think>x</think><answer>5.0 to 6.0</answer>"}
GOOD = {"video": "videos/a.mp4", "query": "the white flash", "span": [5.0, 6.0],
        "messages": [{"role": "assistant", "content": "<think>look</think>\n" + CALL}, TOOL, ANSWER]}


def test_the_rule_trajectories_load(tmp_path):
    out = tmp_path / "zoom"
    write_zoom_dataset(out, 4, seed=0, task=ZoomTask(duration=30.0))
    trajectories = load_trajectories(out / "trajectories.jsonl")
    lines = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajectories) == len(lines) == 3
    for t, line in zip(trajectories, lines):
        assert [list(w) for w in t.windows] == [line["window"]] and len(t.turns) == 2
        assert t.sample.video == str(out / line["video"]) and t.sample.span == tuple(line["span"])
        assert t.sample.origin.endswith(f"trajectories.jsonl:{lines.index(line) + 1}")


def _bad(tmp_path, record) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + (record if isinstance(record, str) else json.dumps(record)) + "\n")
    with pytest.raises(UserError) as e:
        load_trajectories(path)
    message = str(e.value)
    assert message.startswith(f"{path}:2") and "\n" not in message
    return message


def _with(**messages) -> dict:
    rec = json.loads(json.dumps(GOOD))
    for k, v in messages.items():
        rec["messages"][int(k[1:])] = v
    return rec


def test_bad_trajectories_are_one_line(tmp_path):
    assert "not JSON" in _bad(tmp_path, "{oops")
    assert "needs the keys video, query, span, messages" in _bad(tmp_path, {"video": "a.mp4"})
    assert "span must be" in _bad(tmp_path, dict(GOOD, span=[6.0, 5.0]))
    assert "an odd count" in _bad(tmp_path, dict(GOOD, messages=GOOD["messages"][:2]))
    assert "message 1: expected a tool turn, got 'user'" in _bad(tmp_path, _with(m1={"role": "user",
                                                                                      "content": "hi"}))
    image = {"role": "tool", "content": [{"type": "image"}, {"type": "video", "video_start": 4.0, "video_end": 8.0}]}
    assert "message 1: a tool turn holds text and one video clip; the zoom tool returns no 'image'" in \
        _bad(tmp_path, _with(m1=image))
    two = {"role": "tool", "content": [TOOL["content"][1], TOOL["content"][1]]}
    assert "exactly one video clip, this one 2" in _bad(tmp_path, _with(m1=two))
    moved = {"role": "tool", "content": [{"type": "video", "video_start": 3.0, "video_end": 8.0}]}
    assert "the clip is [3, 8] but the call asked for [4, 8]" in _bad(tmp_path, _with(m1=moved))
    assert "the call cannot be run: it calls no tool" in _bad(tmp_path, _with(m0={"role": "assistant",
                                                                                  "content": "no call"}))
    bad_call = {"role": "assistant", "content": "<tool_call>\nzoom(4, 8)\n</tool_call>"}
    assert "the call cannot be run: the call is not JSON" in _bad(tmp_path, _with(m0=bad_call))
    assert "message 2: the last model turn calls the tool" in _bad(tmp_path, _with(m2={"role": "assistant",
                                                                                      "content": CALL}))


def test_an_empty_or_missing_file_is_one_line(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no trajectories"):
        load_trajectories(tmp_path / "e.jsonl")
    with pytest.raises(UserError, match="cannot read the trajectories"):
        load_trajectories(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_trajectory_trains_as_its_whole_conversation(family, tmp_path, load_tiny):
    """The rule trajectory's completion (model turns, the tool's turns with their clips) behind its overview prompt:
    the grouped forward equals the whole conversation forwarded by the model (logprobs and gradients, float32), the
    model's own tokens are the loss's, and the tool turns are the environment's."""
    from grouping_check import compare

    from mmpg.data.prompts import build_prompt_inputs, get_template
    from mmpg.data.video import VideoSpec, load_video
    from mmpg.rollout.zoom import ZoomEnvironment, ZoomSettings, clip_turn, turn_inputs
    from mmpg.sft.trajectories import trajectory_completion

    model, processor = load_tiny(family)
    task = ZoomTask(duration=30.0)
    write_zoom_dataset(tmp_path / "z", 3, seed=1, task=task)
    (trajectory, *_) = load_trajectories(tmp_path / "z" / "trajectories.jsonl")
    f2 = VideoSpec.for_family(family).factor ** 2
    spec = VideoSpec.for_family(family, fps=task.overview_fps, min_frames=4, max_frames=768, min_pixels=4 * f2,
                                max_pixels=4 * f2)
    env = ZoomEnvironment(ZoomSettings(fps=task.zoom_fps, max_frames=task.zoom_max_frames, max_turns=2), spec)
    stop = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, own, clips = trajectory_completion(processor, trajectory, env, stop)
    window = trajectory.windows[0]
    tool_ids, _ = turn_inputs(processor, env.step(trajectory.sample, trajectory.turns[0], 0))
    assert int((own == 0).sum()) == tool_ids.numel() and clips["video_grid_thw"].shape[0] == 1
    assert processor.tokenizer.decode(ids[own == 0][:12]).startswith(clip_turn(*window)[:12])
    sample = trajectory.sample
    video = load_video(sample.video, spec)
    inputs = build_prompt_inputs(processor, [sample], [video], get_template("time_r1"))
    compare(model, inputs, ids[None], torch.ones_like(ids)[None], [1], completion_visuals=[clips])
    with pytest.raises(UserError, match="refuses the call of message 0"):
        strict = ZoomEnvironment(ZoomSettings(fps=task.zoom_fps, max_frames=8, max_turns=2), spec)
        trajectory_completion(processor, trajectory, strict, stop)  # its window is longer than 8 frames show
