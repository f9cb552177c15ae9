"""Multi-turn SFT trajectories (`mmpg.sft.trajectories`): the zoom task's rule trajectories load as written, and
what the chat templates cannot express or the tool would not have returned is one line naming the file, the line
and the message."""

from __future__ import annotations

import json

import pytest

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
