"""GRPO with the zoom tool (data.template=zoom) on the HF engine: multi-turn rollouts, the tool's reward terms, the
loss on the model's own tokens, the trajectory tree in the update and in the self-check, the rollout records with
each trajectory's turns. The tool is scripted (tests/zoom_worker.py: a random tiny model never writes a call)."""

from __future__ import annotations

import json

import pytest

from train_utils import metrics, overrides, run_forked


def _args(grpo_data, zoom_data, out, name, **extra):
    base = {"data.train": str(zoom_data / "train.json"), "data.videos": str(zoom_data / "videos"),
            "data.template": "zoom", "data.fps": 0.5, "data.max_frames": 768, "zoom.fps": 2.0,
            "zoom.max_frames": 4, "zoom.max_turns": 2, "zoom.call_cost": 0.1, "zoom.error_penalty": 0.5,
            "zoom.window_weight": 0.5, "reward.function": "", "rollout.max_new_tokens": 6,
            "trainer.total_steps": 2, "logging.rollouts_every": 1, "algorithm.self_check": "on"}
    base.update(extra)
    return ["train"] + overrides(grpo_data, out, name, **base)


@pytest.mark.slow
def test_grpo_with_the_zoom_tool(grpo_data, zoom_data, tmp_path):
    proc = run_forked("zoom_worker:main", _args(grpo_data, zoom_data, tmp_path, "zoom"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = metrics(tmp_path / "zoom")
    assert [m["step"] for m in lines] == [1, 2]
    first = lines[0]
    # the self-check ran on a micro-batch whose responses hold clips: logprobs, gradients, leak within bounds
    assert first["check/grouped_vs_repeated_max"] <= first["check/bound"]
    assert first["check/gradient_rel_max"] <= first["check/gradient_rel_bound"]
    assert first["check/leak_max"] <= first["check/leak_bound"]
    for m in lines:
        # the engine's logprobs of the model's own tokens equal the update's (float32): rollout and training
        # score the same conversation, tool turns and clips included
        assert m["actor/logprob_gap_max"] <= 1e-5, m["actor/logprob_gap_max"]
        assert "reward/zoom_errors" in m and "reward/zoom_window_iou" in m
        assert abs(m["reward/zoom_cost"] + 0.1 * m["reward/zoom_calls"]) < 1e-9
        assert 0 < m["response/length_max"] <= 3 * 6  # the model's own tokens: 3 turns of at most 6, no tool turn
        assert abs(m["reward/zoom_error_penalty"] + 0.5 * m["reward/zoom_errors"]) < 1e-9
        assert abs(m["reward/mean"] - (m["reward/answer"] + m["reward/zoom_cost"] + m["reward/zoom_error_penalty"]
                                       + m["reward/zoom_window"])) < 1e-6
    assert any(m["reward/zoom_calls"] > 0 for m in lines)
    records = [json.loads(line) for line in (tmp_path / "zoom" / "rollouts" / "step_00000001.jsonl").open()]
    responses = [r for g in records for r in g["responses"]]
    zooms = [t for r in responses for t in r["turns"] if "zoom" in t]
    assert zooms and all(len(t["zoom"]) == 2 for t in zooms)
    for r in responses:  # the record's text is the last model turn; each model turn but the last one called
        models = [t["model"] for t in r["turns"] if "model" in t]
        assert r["text"] == models[-1] and len(r["turns"]) == 2 * len(models) - 1
        assert r["rewards"]["zoom_calls"] == sum("zoom" in t for t in r["turns"])


def test_zoom_refusals(grpo_data, zoom_data, tmp_path, tiny_dirs):
    """One line, exit 2, before anything trains: the path multi-turn rollouts do not take (copy decoding under
    sequence parallelism),
    a reward term out of range, a zoom longer than the model's positions (checked when the model is loaded, before
    the first step), a text-only model."""
    from train_utils import run_cli

    from mmpg.config import load_config
    from mmpg.errors import UserError
    from mmpg.rl.trainer import check_zoom_config

    with pytest.raises(UserError, match="sequence_parallel_size > 1 and rollout.decode=copy: a later turn would"):
        check_zoom_config(load_config(None, ["data.template=zoom", "parallel.sequence_parallel_size=2",
                                             "rollout.decode=copy"]))
    for extra, words in (({"zoom.call_cost": -1}, "zoom.call_cost"),
                         ({"zoom.max_frames": 20000, "zoom.fps": 100.0}, "past the model's 32768 positions"),
                         ({"model.path": str(tiny_dirs["qwen2"])}, "needs a video model")):
        proc = run_cli(_args(grpo_data, zoom_data, tmp_path, "r", **extra))
        assert proc.returncode == 2 and words in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_worst_clip_is_counted(family, load_tiny, zoom_data):
    """`worst_clip_tokens` (the length check's zoom turn) is what the tool's turn of a full-length window holds,
    text and clip, counted by the model's processor: equal where the clip's frames are at max_pixels, but for the
    longer times the worst case writes (an hour's seconds instead of this clip's: in the turn's text, and in Qwen3-VL's
    per-block timestamps, at most 3 tokens more a block)."""
    from mmpg.config import load_config
    from mmpg.data.samples import GroundingSample
    from mmpg.data.video import VideoSpec
    from mmpg.rollout.lengths import worst_clip_tokens
    from mmpg.rollout.zoom import ZoomEnvironment, ZoomSettings, call_text, turn_inputs

    _, processor = load_tiny(family)
    f2 = VideoSpec.for_family(family).factor ** 2
    cfg = load_config(None, ["data.template=zoom", f"data.min_pixels={4 * f2}", f"data.max_pixels={4 * f2}",
                             "zoom.fps=2.0", "zoom.max_frames=8"])
    spec = VideoSpec.for_family(family, fps=0.5, min_pixels=4 * f2, max_pixels=4 * f2)
    env = ZoomEnvironment(ZoomSettings(2.0, 8, 2), spec)
    sample = GroundingSample("s", str(zoom_data / "videos" / "zoom_00000.mp4"), 16.0, "q", (1.0, 2.0))
    tool = env.step(sample, call_text(4.0, 8.0), 0)
    ids, visuals = turn_inputs(processor, tool)
    assert int(visuals["video_grid_thw"][0, 0]) == 4  # 8 frames: the most the tool returns
    from mmpg.rollout.lengths import WORST_DURATION_S

    tok = processor.tokenizer
    digits = len(tok(f"{WORST_DURATION_S:.1f} to {WORST_DURATION_S:.1f}")["input_ids"]) - len(tok("4.0 to 8.0")["input_ids"])
    worst = worst_clip_tokens(cfg, processor)
    if family == "qwen2_5_vl":
        assert worst == ids.numel() + digits
    else:
        assert ids.numel() + digits <= worst <= ids.numel() + digits + 3 * 4, (worst, ids.numel(), digits)


def _rel(a: dict, b: dict) -> float:
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a)
    return (num / sum(float((a[k].double() ** 2).sum()) for k in a)) ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("errors", [False, True], ids=["a-rank-ends-first", "a-rank-without-clips"])
def test_two_zero3_ranks_train_what_one_process_trains(grpo_data, zoom_data, tmp_path, errors, monkeypatch):
    """ZeRO-3 on 2 ranks (every parameter partitioned) samples the trajectories one process samples (each branch
    seeded by its prompt, row and turn), with the ranks' turns in lockstep behind their kept K/V (a rank whose
    branches ended runs the turn's forwards idle while the other's go on; `errors`: a rank whose turn holds only error
    turns runs a stand-in clip through the vision tower while the other's clips go through it), and trains the same
    update: loss, gradient norm, final weights."""
    monkeypatch.setenv("MMPG_ZOOM_ERRORS", "1" if errors else "0")
    from train_utils import final_weights

    from test_train_distributed import LOSS_ATOL, NORM_RTOL, WEIGHT_RTOL, ZERO3

    config = tmp_path / "zero3.json"
    config.write_text(json.dumps(ZERO3))
    extra = {"data.batch_size": 2, "trainer.micro_batch_size": 4, "data.shuffle": False,
             "checkpoint.every_n_steps": 2, "algorithm.self_check": "off"}
    one = run_forked("zoom_worker:main", _args(grpo_data, zoom_data, tmp_path, "one", **extra))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_forked("zoom_worker:main", _args(grpo_data, zoom_data, tmp_path, "two", **extra,
                                               **{"deepspeed.config": str(config)}), procs=2)
    assert two.returncode == 0, two.stderr[-5000:]
    a, b = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [m["step"] for m in a] == [1, 2]
    for x, y in zip(a, b):
        assert x["reward/mean"] == y["reward/mean"] and x["reward/zoom_calls"] == y["reward/zoom_calls"]
        assert abs(x["actor/loss"] - y["actor/loss"]) <= LOSS_ATOL
        assert abs(x["actor/grad_norm"] - y["actor/grad_norm"]) <= NORM_RTOL * y["actor/grad_norm"]
    assert b[0]["actor/grad_norm"] > 0
    assert _rel(final_weights(tmp_path / "two", 2), final_weights(tmp_path / "one", 2)) <= WEIGHT_RTOL


@pytest.mark.slow
def test_two_sequence_parallel_ranks_train_what_one_process_trains(grpo_data, zoom_data, tmp_path, monkeypatch):
    """sp = 2 (one group: each rank decodes half of each overview's frames, the group encodes the videos together
    and shares every packed row): the two ranks split the prompts' sampling (their turns in lockstep behind kept
    K/V) and gather the trajectories, and train what one process trains on the trajectory tree."""
    from test_train_distributed import LOSS_ATOL, NORM_RTOL

    monkeypatch.setenv("MMPG_ZOOM_ERRORS", "1")
    extra = {"data.batch_size": 2, "trainer.micro_batch_size": 4, "data.shuffle": False, "data.max_frames": 8}
    one = run_forked("zoom_worker:main", _args(grpo_data, zoom_data, tmp_path, "one", **extra))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_forked("zoom_worker:main", _args(grpo_data, zoom_data, tmp_path, "sp2", **extra,
                                               **{"parallel.sequence_parallel_size": 2}), procs=2)
    assert two.returncode == 0, two.stderr[-5000:]
    a, b = metrics(tmp_path / "sp2"), metrics(tmp_path / "one")
    assert [m["step"] for m in a] == [1, 2] and any(m["reward/zoom_calls"] > 0 for m in b)
    for x, y in zip(a, b):
        assert x["reward/mean"] == y["reward/mean"] and x["reward/zoom_calls"] == y["reward/zoom_calls"]
        assert abs(x["actor/loss"] - y["actor/loss"]) <= LOSS_ATOL
        assert abs(x["actor/grad_norm"] - y["actor/grad_norm"]) <= NORM_RTOL * y["actor/grad_norm"]
        assert x["data/frames_decoded_max"] * 2 == y["data/frames_decoded_max"] > 0  # each rank its half
    assert a[0]["check/gradient_rel_max"] <= a[0]["check/gradient_rel_bound"]  # the self-check on sharded rows


@pytest.mark.slow
def test_lora_with_the_zoom_tool(grpo_data, zoom_data, tmp_path):
    """LoRA adapters, the KL reference as the policy with its adapters off: multi-turn rollouts, the trajectory tree
    in the self-check (with autograd) and in the update; the adapters train."""
    args = _args(grpo_data, zoom_data, tmp_path, "lora", **{"model.lora.r": 4, "model.lora.alpha": 8,
                                                             "algorithm.beta": 0.04})
    proc = run_forked("zoom_worker:main", args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = metrics(tmp_path / "lora")
    first = lines[0]
    assert first["check/grouped_vs_repeated_max"] <= first["check/bound"]
    assert first["check/gradient_rel_max"] <= first["check/gradient_rel_bound"]
    assert all(m["actor/logprob_gap_max"] <= 1e-5 for m in lines) and any(m["reward/zoom_calls"] > 0 for m in lines)
    assert all(m["actor/grad_norm"] > 0 and m["actor/kl"] >= 0 for m in lines)


@pytest.mark.slow
def test_mmpg_eval_runs_the_zoom_protocol(grpo_data, zoom_data, tmp_path):
    """`mmpg eval template=zoom`: each answer a multi-turn trajectory (the engine's logprobs of the model's turns
    checked against the repeated forward of the whole conversation), its record holding the turns, metrics.json and
    report.md the zooms, error turns, clip frames and mIoU by zoom count; two ranks write what one process writes."""
    from mmpg.runs.evals import EvalReader

    def run(out, procs, *more):
        args = ["eval", "--checkpoint", grpo_data["model"], "--annotations", str(zoom_data / "train.json"),
                "--videos", str(zoom_data / "videos"), "--out", str(out), "template=zoom", "fps=0.5",
                "max_frames=768", "min_pixels=3136", "max_pixels=3136", "max_new_tokens=6", "num_workers=0",
                "batch_size=1", "zoom_fps=2", "zoom_max_frames=4", "zoom_max_turns=2", "share_videos=false", *more]
        proc = run_forked("zoom_worker:main", args, procs=procs)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return EvalReader(out)

    one = run(tmp_path / "one", 1)
    records, metrics = one.predictions(), one.metrics()
    assert len(records) == 3 and all(r.turns and r.turns[-1] == {"model": r.text} for r in records)
    zooms = [sum("zoom" in t for t in r.turns) for r in records]
    assert sum(zooms) > 0 and all(t["frames"] > 0 for r in records for t in r.turns if "zoom" in t)
    assert metrics["zoom/calls_mean"] == pytest.approx(sum(zooms) / 3)
    assert sum(metrics[f"zoom/count@{k}"] for k in set(zooms)) == 3
    report = (tmp_path / "one" / "report.md").read_text()
    assert "## Zoom protocol" in report and "| zooms | samples | mIoU (%) |" in report
    two = run(tmp_path / "two", 2, f"frame_cache={tmp_path / 'frames'}")  # the clips through the frame cache too
    assert [(r.index, r.text, r.turns) for r in two.predictions()] == [(r.index, r.text, r.turns) for r in records]
    assert len(list((tmp_path / "frames").rglob("*.frames"))) > 3  # the overviews and the clips stored
