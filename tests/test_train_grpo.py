"""`mmpg train` end to end on the CPU, each run in a fresh process as a user starts it: grouped vs repeated forward
give the same training, a policy learns a reward it can earn, bad input is one line with exit status 2."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from train_utils import final_weights, metrics, overrides, run_cli

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-5  # per-step loss, grouping true vs false (float32; measured below 1e-6)
WEIGHT_RTOL = 1e-5  # ||w_grouped - w_repeated|| / ||w|| over all weights after 5 steps


def _train(args, timeout=600):
    proc = run_cli(["train"] + args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _rel(a: dict, b: dict) -> float:
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a)
    den = sum(float((a[k].double() ** 2).sum()) for k in a)
    return (num / den) ** 0.5


def _perturbed_copy(model_dir: str, out: Path, scale: float = 0.05) -> Path:
    """The checkpoint with every weight moved by seeded noise: a KL reference that differs from the policy, so the KL
    term and its gradient are of normal size (against an identical reference both are ~0 and only rounding
    noise is compared)."""
    shutil.copytree(model_dir, out)
    weights_file = next(out.glob("*.safetensors"))
    weights = load_file(str(weights_file))
    g = torch.Generator().manual_seed(1)
    noisy = {k: (v + scale * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v
             for k, v in weights.items()}
    save_file(noisy, str(weights_file), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("variant", [
    {},
    {"algorithm.num_iterations": 2},
    {"algorithm.beta": 0.1},
], ids=["mu1", "mu2", "beta"])
def test_grouped_and_repeated_training_are_the_same(grpo_data, tmp_path, variant):
    """5 steps, same seed: grouping true vs false. Losses are compared against the scale of their terms (with mu = 1
    the policy-gradient loss is -mean(A) = 0 by construction, so a relative comparison of two ~1e-9 values would
    compare rounding noise): |loss_a - loss_b| <= LOSS_RTOL * max(|loss|, 1)."""
    if "algorithm.beta" in variant:
        variant = dict(variant, **{"model.ref_path": str(_perturbed_copy(grpo_data["model"], tmp_path / "ref"))})
    runs = {}
    for grouping in (True, False):
        name = f"g{int(grouping)}"
        _train(overrides(grpo_data, tmp_path, name, **{"algorithm.grouping": grouping, "trainer.total_steps": 5,
                                                        "data.batch_size": 2, **variant}))
        runs[grouping] = tmp_path / name
    a, b = metrics(runs[True]), metrics(runs[False])
    assert [m["step"] for m in a] == [1, 2, 3, 4, 5]
    assert any(abs(m["actor/loss"]) > 0 for m in a), "the test reward must give non-zero advantages"
    for ma, mb in zip(a, b):
        la, lb = ma["actor/loss"], mb["actor/loss"]
        assert abs(la - lb) <= LOSS_RTOL * max(abs(la), abs(lb), 1.0), (ma["step"], la, lb)
        assert ma["reward/mean"] == mb["reward/mean"], "both runs must sample the same responses"
    if "algorithm.beta" in variant:
        assert all(m["actor/kl"] > 1e-3 for m in a)
        for ma, mb in zip(a, b):
            assert abs(ma["actor/kl"] - mb["actor/kl"]) <= LOSS_RTOL * ma["actor/kl"], (ma["actor/kl"], mb["actor/kl"])
    wa, wb = final_weights(runs[True], 5), final_weights(runs[False], 5)
    assert wa.keys() == wb.keys()
    rel = _rel(wa, wb)
    assert rel <= WEIGHT_RTOL, f"final weights differ by {rel:.2e} (relative norm)"
    init = load_file(str(next(Path(grpo_data["model"]).glob("*.safetensors"))))
    moved = max(float((wa[k] - init[k]).abs().max()) for k in init if k in wa)
    assert moved > 1e-4, "the weights must really move (not a comparison of two untouched models)"


def test_policy_learns_a_reward_it_can_earn(grpo_data, tmp_path):
    """Reward = share of spaces in the response: a random policy earns ~7 % of it; 20 GRPO steps at lr 1e-2 push it
    up (measured: 0.07 -> 0.2 at step 15, 0.9 at step 30 with 8 responses per prompt)."""
    _train(overrides(grpo_data, tmp_path, "learn", **{
        "reward.function": "reward_fns:space_share", "trainer.total_steps": 20, "rollout.n": 8,
        "trainer.micro_batch_size": 16, "optim.lr": 1e-2}))
    rewards = [m["reward/mean"] for m in metrics(tmp_path / "learn")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.05, f"mean reward of the first 5 steps {first:.3f}, of the last 5 {last:.3f}"


def test_run_directory_contents(grpo_data, tmp_path):
    _train(overrides(grpo_data, tmp_path, "r", **{"trainer.total_steps": 2, "checkpoint.every_n_steps": 1,
                                                   "checkpoint.keep_last": 1, "logging.tensorboard": True,
                                                   "reward.function": ""}))
    from mmpg.runs import RunReader

    reader = RunReader(tmp_path / "r")
    assert reader.info()["kind"] == "grpo"
    # what the fast paths chose (mmpg.choices), kept current by the trainer; the run header says it too
    assert reader.info()["fast_paths"]["grouped_backend"]["value"] == "sdpa"
    assert "fast paths: grouped_backend=sdpa" in (tmp_path / "r" / "train.log").read_text()
    assert reader.config()["rollout"]["n"] == 4
    lines = reader.metrics()
    assert [m["step"] for m in lines] == [1, 2]
    for key in ("reward/mean", "reward/iou", "reward/format", "response/length_mean", "actor/kl",
                "actor/clip_fraction", "actor/entropy", "actor/grad_norm", "actor/lr", "timing_s/rollout",
                "timing_s/reward", "timing_s/logprob", "timing_s/update", "timing_s/step", "perf/tokens_per_s",
                "perf/peak_memory_mb", "data/skipped", "data/zero_adv_groups", "actor/logprob_gap_mean"):
        assert key in lines[0], key
    assert lines[0]["actor/logprob_gap_max"] < 1e-3  # the rollout's logprobs are the training forward's
    # the self-check ran on the first step (on by default), in this run's dtype and backend
    assert 0 <= lines[0]["check/grouped_vs_repeated_max"] <= lines[0]["check/bound"] == 1e-4
    assert lines[0]["check/group_max"] == 4 and lines[0]["check/prefix_max"] > 0
    assert 0 < lines[0]["timing_s/self_check"] < lines[0]["timing_s/step"]
    assert "alarm/logprob_drift" not in lines[-1]
    assert reader.steps() == [1, 2]
    # the wait for the batch (synchronous: every wait on the loader, here num_workers 0: the whole decode) and how
    # its videos were had: each distinct video of the step decoded from its file once, none from a frame cache
    for m in lines:
        assert 0 < m["timing_s/data"] < m["timing_s/step"], m
        assert m["data/videos_decoded"] == len({g.video for g in reader.rollouts(m["step"])}), m
        assert m["data/videos_cached"] == 0
    groups = reader.rollouts(1)
    assert len(groups) == 2 and all(len(g.responses) == 4 for g in groups)
    assert [g.group_index for g in groups] == [0, 1]
    for g in groups:
        assert g.gt_span[0] < g.gt_span[1] and g.duration > 0
        assert all(r.finish_reason in ("stop", "length") and r.length >= 1 for r in g.responses)
        pictures, times = reader.thumbnails(g.media_key)
        assert len(pictures) == 4 and len(times) == 4
    assert [s for s, _ in reader.checkpoints()] == [2]  # keep_last 1
    assert list((tmp_path / "r" / "tb").iterdir())
    # the HF checkpoint loads with plain transformers
    from transformers import AutoModelForImageTextToText, AutoProcessor

    ckpt = reader.checkpoints()[0][1]
    AutoModelForImageTextToText.from_pretrained(ckpt)
    AutoProcessor.from_pretrained(ckpt)


def test_a_second_run_reads_every_video_from_the_frame_cache_and_trains_the_same(grpo_data, tmp_path):
    """data.frame_cache: the first run decodes and stores each video, the second (same config) reads them all back
    (no file decoded, counted) and, its frames bit-equal, samples and trains exactly what the first did."""
    cache = {"trainer.total_steps": 2, "data.frame_cache": str(tmp_path / "frames"), "data.shuffle": False}
    for name in ("first", "second"):
        _train(overrides(grpo_data, tmp_path, name, **cache))
    first, second = metrics(tmp_path / "first"), metrics(tmp_path / "second")
    seen = [m["data/videos_decoded"] + m["data/videos_cached"] for m in first]  # each step's distinct videos
    assert first[0]["data/videos_cached"] == 0 and first[0]["data/videos_decoded"] > 0  # an empty cache at first
    assert [m["data/videos_decoded"] for m in second] == [0, 0]
    assert [m["data/frames_decoded_max"] for m in second] == [0, 0] and first[0]["data/frames_decoded_max"] > 0
    assert [m["data/videos_cached"] for m in second] == seen
    for a, b in zip(first, second):
        same = [k for k in a if k != "time" and not k.startswith(("timing_s/", "perf/", "data/videos_", "data/frames_"))
                and k in b]
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert _rel(final_weights(tmp_path / "second", 2), final_weights(tmp_path / "first", 2)) == 0.0


def _damage(grpo_data, tmp_path):
    """A copy of the synthetic set with one training video corrupted and one missing."""
    synth = tmp_path / "synth"
    shutil.copytree(grpo_data["synth"], synth)
    train = json.loads((synth / "train.json").read_text())
    ids = list(train)
    (synth / "videos" / f"{ids[0]}.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video")
    (synth / "videos" / f"{ids[1]}.mp4").unlink()
    return {"model": grpo_data["model"], "synth": synth}, len(train[ids[0]]["sentences"]) + \
        len(train[ids[1]]["sentences"])


def test_bad_videos_are_skipped_and_counted(grpo_data, tmp_path):
    data, bad = _damage(grpo_data, tmp_path)
    _train(overrides(data, tmp_path, "skip", **{"trainer.total_steps": 6, "data.batch_size": 2,
                                                 "data.shuffle": False}))
    lines = metrics(tmp_path / "skip")
    assert [m["step"] for m in lines] == list(range(1, 7))
    assert lines[-1]["data/skipped_total"] >= bad
    assert sum(m["data/skipped"] for m in lines) == lines[-1]["data/skipped_total"]


def test_bad_videos_in_strict_mode_stop_with_one_line(grpo_data, tmp_path):
    data, _ = _damage(grpo_data, tmp_path)
    proc = run_cli(["train"] + overrides(data, tmp_path, "strict", **{"data.strict": True, "data.shuffle": False,
                                                                      "data.num_workers": 1}))
    assert proc.returncode == 2, proc.stderr[-3000:]
    # the error is the last thing mmpg prints; the DataLoader worker, a second process on the same stderr, may still
    # be decoding the next batch, so decord's own "ERROR opening" lines can land before, after or inside mmpg's line
    errors = [line for line in proc.stderr.splitlines() if "mmpg: error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    first, *rest = proc.stderr[proc.stderr.index("mmpg: error:"):].strip().splitlines()
    assert ".mp4" in first and "sample" in first, first
    assert all("mmpg:" not in line for line in rest), rest  # nothing more of mmpg's after its one line
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra, words", [
    ({"rollout.n": 1}, ["rollout.n=1", "at least 2"]),
    ({"trainer.micro_batch_size": 6}, ["micro_batch_size=6", "split a group"]),
    ({"rollout.temprature": 1.0}, ["rollout.temprature", "rollout.temperature"]),
    ({"model.path": "models/q25"}, ["models/q25"]),
    ({"data.train": "no/such/annotations.json"}, ["no/such/annotations.json"]),
    ({"logging.wandb": True}, ["wandb"]),
    ({"data.max_pixels": 1000}, ["data.max_pixels=1000 is below data.min_pixels=3136", "qwen2_5_vl"]),
    ({"data.min_pixels": 500, "data.max_pixels": 500}, ["data.min_pixels=500", "one visual token", ">= 784"]),
], ids=["G=1", "split-group", "unknown-key", "missing-model", "missing-annotations", "no-wandb", "pixels-order",
        "pixels-below-a-token"])
def test_bad_input_is_one_line_and_writes_nothing(grpo_data, tmp_path, extra, words):
    if "logging.wandb" in extra and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    out = tmp_path / "out"
    proc = run_cli(["train"] + overrides(grpo_data, out, "bad", **extra), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mmpg: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    assert not out.exists()


def test_self_check_stops_a_wrong_grouped_forward(grpo_data, tmp_path):
    """tests/perturbed_forward.py (imported as the reward's module) shifts the responses' positions in the grouped
    forward: the first step's self-check stops the run with one line, before any update; with
    algorithm.self_check=warn the run goes on and says so in its log."""
    bad = {"reward.function": "perturbed_forward:digit_share", "trainer.total_steps": 1}
    proc = run_cli(["train"] + overrides(grpo_data, tmp_path, "wrong", **bad), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mmpg: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("mmpg: error: self-check: the grouped forward differs from the repeated forward by")
    assert "transformers" in lines[0] and "backend sdpa" in lines[0]
    assert not (tmp_path / "wrong" / "checkpoints").exists() or not any((tmp_path / "wrong" / "checkpoints").iterdir())
    _train(overrides(grpo_data, tmp_path, "warned", **bad, **{"algorithm.self_check": "warn"}))
    assert metrics(tmp_path / "warned")[0]["check/grouped_vs_repeated_max"] > 1e-4
    assert "self-check: the grouped forward differs" in (tmp_path / "warned" / "train.log").read_text()


def test_an_existing_run_is_not_overwritten(grpo_data, tmp_path):
    _train(overrides(grpo_data, tmp_path, "once", **{"trainer.total_steps": 1}))
    proc = run_cli(["train"] + overrides(grpo_data, tmp_path, "once", **{"trainer.total_steps": 1}))
    assert proc.returncode == 2 and "resume" in proc.stderr
    assert len(metrics(tmp_path / "once")) == 1


def test_prompt_seeds_depend_on_step_sample_and_round_only():
    """Runs on different numbers of ranks sample the same responses because seeds come from (seed, step, sample id,
    round) and nothing else."""
    from mmpg.rl.collect import prompt_seed

    assert prompt_seed(0, 1, "a#0", 1) == prompt_seed(0, 1, "a#0", 1)
    seeds = {prompt_seed(0, s, sid, r) for s in range(50) for sid in ("a#0", "a#1", "b#0") for r in (1, 2)}
    assert len(seeds) == 50 * 3 * 2


def test_the_data_wait_is_the_slowest_ranks_and_the_videos_are_summed():
    """Each rank's collect info as `dist.gather_data` hands it to rank 0: timing_s/data is the slowest rank's wait
    (as every timing_s/*), data/videos_decoded|cached the sums; a rank whose batches counted nothing adds 0."""
    from mmpg.rl.step_log import step_metrics

    base = {"skipped": 0, "dropped_groups": 0, "rounds": 1}
    infos = [{**base, "timing": {"data": 0.5, "step": 2.0}, "videos_decoded": 3, "videos_cached": 1},
             {**base, "timing": {"data": 1.25, "step": 2.5}, "videos_decoded": 2, "videos_cached": 0},
             {**base, "timing": {"step": 1.0}}]
    m = step_metrics([], {}, infos, 0, "cpu")
    assert m["timing_s/data"] == 1.25 and m["timing_s/step"] == 2.5
    assert m["data/videos_decoded"] == 5.0 and m["data/videos_cached"] == 1.0


def test_dynamic_sampling_dapo_and_eval_during_training(grpo_data, tmp_path):
    """The options a DAPO-style run uses, together: dynamic sampling (digit_share is 0 for most groups of a random
    policy, so groups are dropped and more prompts drawn), token-level loss, truncated responses masked, batch-std
    advantages, and a held-out evaluation every 2 steps written to eval.jsonl."""
    synth = grpo_data["synth"]
    _train(overrides(grpo_data, tmp_path, "dapo", **{
        "algorithm.dynamic_sampling": True, "algorithm.max_sampling_rounds": 3, "algorithm.loss_type": "dapo",
        "algorithm.mask_truncated": True, "algorithm.scale_rewards": "batch", "algorithm.epsilon_high": 0.28,
        "trainer.total_steps": 4, "eval.every_n_steps": 2, "data.val": str(synth / "val.json"),
        "eval.max_new_tokens": 8}))
    lines = metrics(tmp_path / "dapo")
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert sum(m["data/dropped_groups"] for m in lines) > 0
    assert max(m["data/sampling_rounds"] for m in lines) > 1
    assert all(m["data/sampling_rounds"] <= 3 for m in lines)
    assert all(math.isfinite(m["actor/loss"]) and math.isfinite(m["actor/grad_norm"]) for m in lines
               if "actor/loss" in m)
    evals = [json.loads(line) for line in (tmp_path / "dapo" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert e["eval/count"] == 1.0 and 0.0 <= e["eval/miou"] <= 1.0 and "eval/r1@0.5" in e
    # the same decode path as `mmpg eval`: an evaluation folder per step in the run, which the inspector lists
    from mmpg_app.evals import run_evals
    from mmpg.runs.evals import EvalReader

    folders = run_evals(tmp_path / "dapo")
    assert len(folders) == 2, folders
    for step, e in zip((2, 4), evals):
        reader = EvalReader(tmp_path / "dapo" / "evals" / "val" / f"step_{step:08d}")
        assert reader.info()["step"] == step and len(reader.predictions()) == 1
        assert reader.metrics()["miou"] == pytest.approx(e["eval/miou"])
        assert (reader.folder / "report.md").is_file()


def test_queries_of_a_video_share_it_and_train_the_same(grpo_data, tmp_path):
    """data.queries_per_video=3 keeps a video's queries side by side; the grouped forward then packs them behind one
    shared video (perf/shared_prompts > 0, fewer perf/vision_calls), and 5 steps train the same losses and weights
    as with sharing off and as the repeated forward (the synthetic train split asks 3, 3, 1, 1, 1 and 2 questions
    of its 6 videos)."""
    base = {"data.queries_per_video": 3, "data.batch_size": 6, "rollout.n": 2, "trainer.micro_batch_size": 6,
            "trainer.total_steps": 5, "data.fps": 2.0, "data.max_frames": 16, "data.min_pixels": 50176,
            "data.max_pixels": 50176, "reward.function": "reward_fns:space_share"}  # 512 video tokens: sharing pays
    runs = {}
    for name, extra in (("shared", {}), ("alone", {"algorithm.share_videos": False}),
                        ("repeated", {"algorithm.grouping": False})):
        _train(overrides(grpo_data, tmp_path, name, **base, **extra))
        runs[name] = metrics(tmp_path / name)
    assert sum(m["perf/shared_prompts"] for m in runs["shared"]) > 0
    assert all(m["perf/shared_prompts"] == 0 for m in runs["alone"])
    # the self-check ran the path the step takes: its first check compared a video's queries sharing the video
    assert runs["shared"][0]["check/shared_prompts"] > 0 and runs["alone"][0]["check/shared_prompts"] == 0
    # the counters: the same videos in all three; the rollout prefills a video's shared part once when its queries
    # share (the repeated run keeps algorithm.share_videos, so its rollout shares too), every query's whole prompt
    # with sharing off; the vision tower encodes a video once per forward when its queries share (rollout + update:
    # at least 2 x videos), each query alone otherwise, and each of the G copies in the repeated forward
    for a, b, c in zip(runs["shared"], runs["alone"], runs["repeated"]):
        assert a["perf/videos"] == b["perf/videos"] == c["perf/videos"] >= 1
        assert 0 < a["perf/prefix_tokens"] == c["perf/prefix_tokens"] <= b["perf/prefix_tokens"]
        assert 2 * a["perf/videos"] <= a["perf/vision_calls"] <= b["perf/vision_calls"] < c["perf/vision_calls"]
    assert sum(m["perf/vision_calls"] for m in runs["shared"]) < sum(m["perf/vision_calls"] for m in runs["alone"])
    assert sum(m["perf/prefix_tokens"] for m in runs["shared"]) < sum(m["perf/prefix_tokens"] for m in runs["alone"])
    for other in ("alone", "repeated"):
        for a, b in zip(runs["shared"], runs[other]):
            assert a["reward/mean"] == b["reward/mean"]
            assert abs(a["actor/loss"] - b["actor/loss"]) <= LOSS_RTOL * max(1.0, abs(b["actor/loss"])), (other, a["step"])
        rel = _rel(final_weights(tmp_path / "shared", 5), final_weights(tmp_path / other, 5))
        assert rel <= WEIGHT_RTOL, f"final weights differ from {other} by {rel:.2e}"
