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


def test_a_turn_of_weight_0_is_forwarded_but_not_in_the_loss(tmp_path, load_tiny):
    """`"weight": 0` on a model turn (OpenAI's chat fine-tuning format): the trajectory's conversation is the same, its
    tokens are out of the loss's mask; weights other than 0 and 1, and a trajectory with no turn to train, are one
    line naming the file, the line and the message."""
    from mmpg.data.video import VideoSpec
    from mmpg.rollout.zoom import ZoomEnvironment, ZoomSettings
    from mmpg.sft.trajectories import trajectory_completion

    out = tmp_path / "zoom"
    write_zoom_dataset(out, 4, seed=0, task=ZoomTask(duration=30.0))
    line = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    weighted = json.loads(json.dumps(line))
    weighted["messages"][0]["weight"] = 0
    weighted["messages"][2]["weight"] = 1
    (tmp_path / "w.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(weighted) + "\n")
    plain, zero = load_trajectories(tmp_path / "w.jsonl", out)
    assert plain.weights == (1, 1) and zero.weights == (0, 1) and plain.turns == zero.turns
    _, processor = load_tiny("qwen3_vl")
    spec = VideoSpec.for_family("qwen3_vl", fps=0.5, min_frames=4, max_frames=768, min_pixels=1024, max_pixels=1024)
    env = ZoomEnvironment(ZoomSettings(fps=4.0, max_frames=48, max_turns=2), spec)
    stop = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, own, _ = trajectory_completion(processor, plain, env, stop)
    ids0, own0, _ = trajectory_completion(processor, zero, env, stop)
    first = len(processor.tokenizer(plain.turns[0], add_special_tokens=False)["input_ids"]) + 1  # and its stop
    assert torch.equal(ids, ids0) and int(own[:first].sum()) == first
    assert int(own0[:first].sum()) == 0 and torch.equal(own0[first:], own[first:]) and int(own0.sum()) > 0
    for weight in (2, 0.5, "0", True, None):
        assert f"message 0: weight must be 0 (not in the loss) or 1 (the default), got {weight!r}" in _bad(
            tmp_path, _with(m0=dict(GOOD["messages"][0], weight=weight)))
    none = _with(m0=dict(GOOD["messages"][0], weight=0), m2=dict(ANSWER, weight=0))
    assert "every model turn has weight 0: nothing to train on" in _bad(tmp_path, none)


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


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_sft_list_tools_false_leaves_the_schema_out_of_the_system_turn(family, tmp_path, load_tiny):
    """`sft.list_tools: false` (a cold start's first stage): the zoom prompt without the tool's block in its system
    turn (Qwen2.5-VL keeps its default system text, Qwen3-VL has none) and its user text unchanged; listed, the block
    is there as the released templates write it."""
    import dataclasses

    from mmpg.data.prompts import build_messages, default_system, get_template, tools_system
    from mmpg.eval.protocols import eval_template

    _, processor = load_tiny(family)
    (trajectory, *_) = _rule_trajectories(tmp_path)

    def text(template):
        return processor.apply_chat_template(build_messages(trajectory.sample, None, template, processor),
                                             tokenize=False, add_generation_prompt=True)

    listed, unlisted = text("zoom"), text(dataclasses.replace(get_template("zoom"), list_tools=False))
    system = default_system(processor)
    assert listed.startswith(f"<|im_start|>system\n{tools_system(('zoom',), system)}<|im_end|>\n<|im_start|>user")
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if family == "qwen2_5_vl" else ""
    assert unlisted.startswith(head + "<|im_start|>user") and '"name": "zoom"' not in unlisted
    assert listed.split("<|im_start|>user")[1] == unlisted.split("<|im_start|>user")[1]  # the same user turn
    # `mmpg eval template=zoom zoom_list_tools=false` writes the prompt the unlisted stage trained on
    assert text(eval_template("zoom", list_tools=False)) == unlisted and text(eval_template("zoom")) == listed


def _rule_trajectories(tmp_path):
    write_zoom_dataset(tmp_path / "z", 3, seed=1, task=ZoomTask(duration=30.0))
    return load_trajectories(tmp_path / "z" / "trajectories.jsonl")


def _zoom_overrides(grpo_data, zoom_data, out, name, **extra):
    from train_utils import overrides

    base = {"data.train": "", "data.videos": str(zoom_data), "data.template": "zoom", "data.fps": 0.5,
            "data.max_frames": 768, "data.batch_size": 3, "data.shuffle": False, "zoom.fps": 4.0,
            "zoom.max_frames": 48, "sft.trajectories": str(zoom_data / "trajectories.jsonl"),
            "trainer.micro_batch_size": 1, "trainer.total_steps": 10, "optim.lr": 3e-3, "reward.function": ""}
    base.update(extra)
    return ["sft"] + overrides(grpo_data, out, name, **base)


@pytest.mark.slow
def test_mmpg_sft_trains_on_the_zoom_trajectories(grpo_data, zoom_data, tmp_path):
    """`mmpg sft` with sft.trajectories on `mmpg synth --zoom` data: the targets are the whole conversations, the
    loss covers exactly the model's own tokens (each model turn and its stop token) and falls; the vision tower
    encodes each overview and each clip once a step."""
    from train_utils import metrics, run_cli

    from mmpg.models.loading import load_processor

    proc = run_cli(_zoom_overrides(grpo_data, zoom_data, tmp_path, "zoom-sft"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = metrics(tmp_path / "zoom-sft")
    tok = load_processor(grpo_data["model"]).tokenizer
    own = sum(len(tok(turn, add_special_tokens=False)["input_ids"]) + 1
              for t in load_trajectories(zoom_data / "trajectories.jsonl") for turn in t.turns)
    assert all(m["sft/target_tokens"] == own for m in lines), (own, [m["sft/target_tokens"] for m in lines])
    assert all(m["perf/vision_calls"] == 6 for m in lines)  # 3 overviews, 3 clips
    first, last = lines[0]["sft/loss"], lines[-1]["sft/loss"]
    assert last < first - 1.0, (first, last)  # measured: 6.60 -> 4.36


@pytest.mark.slow
def test_two_sequence_parallel_ranks_train_the_trajectories_as_one_process(grpo_data, zoom_data, tmp_path):
    """sp = 2: each rank decodes half of each overview's frames and holds half of each packed trajectory tree; the
    losses and gradient norms are one process's."""
    from train_utils import metrics, run_cli

    extra = {"data.max_frames": 8, "trainer.total_steps": 3}
    one = run_cli(_zoom_overrides(grpo_data, zoom_data, tmp_path, "one", **extra))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(_zoom_overrides(grpo_data, zoom_data, tmp_path, "sp2", **extra,
                                  **{"parallel.sequence_parallel_size": 2}), procs=2)
    assert two.returncode == 0, two.stderr[-5000:]
    a, b = metrics(tmp_path / "sp2"), metrics(tmp_path / "one")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert abs(x["sft/loss"] - y["sft/loss"]) <= 1e-5, (x["sft/loss"], y["sft/loss"])
        assert abs(x["actor/grad_norm"] - y["actor/grad_norm"]) <= 1e-5 * y["actor/grad_norm"]
        assert x["sft/target_tokens"] == y["sft/target_tokens"]


def test_bad_zoom_configs_are_one_line(grpo_data, zoom_data, tmp_path):
    """Refused before anything trains, exit 2, one line: trajectories behind a prompt without the tool, a line the
    templates cannot express, a zoom setting out of range, the schema left out where no trajectories call the tool."""
    from train_utils import run_cli

    def refused(args):
        proc = run_cli(args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        return proc.stderr.strip().splitlines()[-1]

    assert "data.template=zoom" in refused(_zoom_overrides(grpo_data, zoom_data, tmp_path, "a",
                                                           **{"data.template": "time_r1"}))
    bad = tmp_path / "bad.jsonl"
    record = dict(GOOD, messages=[GOOD["messages"][0], dict(TOOL, content=[{"type": "image"}]), ANSWER])
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps(record) + "\n")
    assert f"{bad}:2: message 1: a tool turn holds text and one video clip" in refused(
        _zoom_overrides(grpo_data, zoom_data, tmp_path, "b", **{"sft.trajectories": str(bad)}))
    assert "zoom.max_frames=1" in refused(_zoom_overrides(grpo_data, zoom_data, tmp_path, "c",
                                                          **{"zoom.max_frames": 1}))
    assert "sft.list_tools" in refused(_zoom_overrides(grpo_data, zoom_data, tmp_path, "d",
                                                       **{"sft.trajectories": "", "sft.list_tools": False}))


@pytest.mark.parametrize("kind, list_tools", [("sft", False), ("sft", True), ("grpo", False)])
def test_heldout_evaluation_uses_the_prompt_the_run_trains_behind(kind, list_tools, zoom_data, tmp_path, monkeypatch):
    """Training's held-out evaluation (`eval.every_n_steps`) of an SFT stage with `sft.list_tools: false` decodes
    behind that stage's prompt, without the tool's schema, and records it (`zoom_list_tools` false, as `mmpg eval
    zoom_list_tools=false` would); a GRPO run's always lists the tool (sft.* is not its config)."""
    import dataclasses
    from types import SimpleNamespace

    from mmpg.config import load_config
    from mmpg.data.prompts import get_template
    from mmpg.train import heldout

    cfg = load_config(None, ["data.template=zoom", f"data.val={zoom_data / 'test.json'}",
                             f"data.videos={zoom_data / 'videos'}", "data.train=",
                             f"sft.trajectories={zoom_data / 'trajectories.jsonl'}", f"sft.list_tools={list_tools}"])
    seen = {}

    def fake_evaluate_loaded(model, processor, name, bench, out, settings, placement, spec, template, **kw):
        seen.update(settings=settings, template=template)
        return SimpleNamespace(metrics={"count": 1, "miou": 0.5, "unparseable": 0.0})

    monkeypatch.setattr(heldout, "evaluate_loaded", fake_evaluate_loaded)
    monkeypatch.setattr(heldout, "load_benchmark", lambda *a, **k: SimpleNamespace(name="test"))
    session = SimpleNamespace(run_dir=str(tmp_path), model=None, processor=None, rank=0, world=1, device="cpu",
                              family="qwen2_5_vl", dtype=torch.float32)
    job = SimpleNamespace(kind=kind, cfg=cfg, session=session, eval_samples=None)
    assert heldout.evaluate_heldout(job, 1)["eval/miou"] == 0.5
    listed = kind != "sft" or list_tools
    assert seen["settings"].zoom_list_tools is listed and seen["template"].list_tools is listed
    assert seen["template"] == dataclasses.replace(get_template("zoom"), list_tools=listed)
