"""Sequence parallelism in training (parallel.sequence_parallel_size): 2 gloo processes that share every packed row
(sp = 2, one data-parallel group) train what one process trains on the same global batch — GRPO under ZeRO-2 and
ZeRO-3 with a KL reference, two passes per step, a video's queries side by side (the video shared in the grouped
forward) and gradient checkpointing, GRPO with LoRA, and SFT, each rank decoding only its frames of each video (GRPO
sampling from the whole videos' features the group encodes together): the same sampled texts and rewards,
losses within 1e-5, gradient norms and final weights within 1e-5 relative. Each rank held about half of every
packed row (perf/row_tokens), and run.json records sp. Bad settings are one line and exit status 2 before anything
is written."""

from __future__ import annotations

import json

import pytest

from train_utils import final_weights, metrics, overrides, run_cli

LOSS_ATOL = 1e-5
NORM_RTOL = 1e-5
WEIGHT_RTOL = 1e-5
TIMEOUT_S = 600
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                               "stage3_prefetch_bucket_size": 0, "stage3_gather_16bit_weights_on_model_save": True}}


def _grpo(grpo_data, out, name, **extra):
    return ["train"] + overrides(grpo_data, out, name, **{
        "data.batch_size": 2, "data.shuffle": False, "trainer.total_steps": 3, "algorithm.beta": 0.01,
        "algorithm.num_iterations": 2, "deepspeed.zero_stage": 2, "data.queries_per_video": 2,
        "rollout.n": 2, "trainer.micro_batch_size": 4, "data.fps": 2.0, "data.max_frames": 8,
        "data.min_pixels": 50176, "data.max_pixels": 50176,  # 256 video tokens: sharing a video's queries pays
        "reward.function": "reward_fns:space_share", "model.gradient_checkpointing": True, **extra})


def _run(args, procs=1):
    proc = run_cli(args, timeout=TIMEOUT_S, procs=procs)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def _rel(a: dict, b: dict) -> float:
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a)
    return (num / sum(float((a[k].double() ** 2).sum()) for k in a)) ** 0.5


def _texts(run_dir) -> list:
    return [[(g["sample_id"], [r["text"] for r in g["responses"]]) for g in map(json.loads, p.read_text().splitlines())]
            for p in sorted((run_dir / "rollouts").glob("step_*.jsonl"))]


def _same_training(sp_dir, one_dir, loss_key="actor/loss") -> None:
    a, b = metrics(sp_dir), metrics(one_dir)
    assert [m["step"] for m in a] == [m["step"] for m in b] and a
    for x, y in zip(a, b):
        assert x.get("reward/mean") == y.get("reward/mean")
        assert abs(x[loss_key] - y[loss_key]) <= LOSS_ATOL, (x["step"], x[loss_key], y[loss_key])
        assert abs(x["actor/grad_norm"] - y["actor/grad_norm"]) <= NORM_RTOL * y["actor/grad_norm"]
    assert json.loads((sp_dir / "run.json").read_text())["sequence_parallel_size"] == 2


@pytest.fixture(scope="module")
def one_grpo(grpo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    _run(_grpo(grpo_data, out, "one"))
    return out / "one"


@pytest.mark.slow
@pytest.mark.parametrize("stage, procs", [(2, 2), (3, 2), (3, 4)])
def test_sp2_grpo_trains_what_one_process_trains(grpo_data, tmp_path, one_grpo, stage, procs):
    """procs 4: 2 data-parallel groups of 2 sequence-parallel ranks, one prompt each per step."""
    extra = {"parallel.sequence_parallel_size": 2}
    if stage == 3:
        (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
        extra["deepspeed.config"] = str(tmp_path / "zero3.json")
    _run(_grpo(grpo_data, tmp_path, "sp2", **extra), procs=procs)
    _same_training(tmp_path / "sp2", one_grpo)
    assert _texts(tmp_path / "sp2") == _texts(one_grpo)  # the 2 ranks split the sampling: the same texts
    assert metrics(one_grpo)[0]["actor/grad_norm"] > 0.1
    assert sum(m["perf/shared_prompts"] for m in metrics(one_grpo)) > 0  # a video's queries shared its forward
    rel = _rel(final_weights(tmp_path / "sp2", 3), final_weights(one_grpo, 3))
    assert rel <= WEIGHT_RTOL, f"final weights differ by {rel:.2e} (relative norm)"
    for x, y in zip(metrics(tmp_path / "sp2"), metrics(one_grpo)):  # each rank held half of each packed row
        if procs == 2:  # (with 2 data-parallel groups each row holds one of the video's two queries)
            assert x["perf/row_tokens"] == -(-y["perf/row_tokens"] // 2), (x["perf/row_tokens"],
                                                                             y["perf/row_tokens"])
        # each rank decoded only its frames of the step's video (8 frames: 4 temporal patches, 2 a rank), and the
        # group sampled from the features it encoded together; with 2 data-parallel groups a rank's half is of its
        # group's video only (a quarter of one process's, or a half where both groups got one video's queries)
        frames, whole = x["data/frames_decoded_max"], y["data/frames_decoded_max"]
        assert whole > 0 and (frames * 2 == whole if procs == 2 else frames * 2 <= whole), (x["step"], frames, whole)
    log = (tmp_path / "sp2" / "train.log").read_text()
    assert f"{procs // 2} data-parallel x 2 sequence-parallel" in log
    # the self-check ran the sharded rows: the shards' gradient figures summed over the sp group equal the repeated
    # forward's (a missing or doubled sum would read 0.5-1)
    first = metrics(tmp_path / "sp2")[0]
    assert first["check/gradient_rel_max"] <= 1e-4 and first["check/leak_max"] == 0.0, first


@pytest.mark.slow
def test_sp2_lora_grpo_and_sft_train_what_one_process_trains(grpo_data, tmp_path):
    lora = {"model.lora.r": 4, "model.lora.alpha": 8, "optim.lr": 1e-2, "algorithm.beta": 0.0}
    _run(_grpo(grpo_data, tmp_path, "lora_one", **lora))
    _run(_grpo(grpo_data, tmp_path, "lora_sp2", **lora, **{"parallel.sequence_parallel_size": 2}), procs=2)
    _same_training(tmp_path / "lora_sp2", tmp_path / "lora_one")
    assert _texts(tmp_path / "lora_sp2") == _texts(tmp_path / "lora_one")
    from safetensors.torch import load_file

    adapters = [load_file(str(tmp_path / run / "checkpoints" / "step_00000003" / "adapter_model.safetensors"))
                for run in ("lora_sp2", "lora_one")]
    assert _rel(*adapters) <= WEIGHT_RTOL
    sft = {"trainer.total_steps": 3, "trainer.micro_batch_size": 1, "data.batch_size": 2, "data.shuffle": False,
           "reward.function": ""}
    _run(["sft"] + overrides(grpo_data, tmp_path, "sft_one", **sft))
    _run(["sft"] + overrides(grpo_data, tmp_path, "sft_sp2", **sft, **{"parallel.sequence_parallel_size": 2}),
         procs=2)
    _same_training(tmp_path / "sft_sp2", tmp_path / "sft_one", loss_key="sft/loss")
    assert _rel(final_weights(tmp_path / "sft_sp2", 3), final_weights(tmp_path / "sft_one", 3)) <= WEIGHT_RTOL
    # each rank decoded only the frames it encodes: its half of every video's temporal patches (a patch is 2 frames;
    # an odd count leaves one rank a patch more), never the whole video as one process does
    for x, y in zip(metrics(tmp_path / "sft_sp2"), metrics(tmp_path / "sft_one")):
        frames, whole = x["data/frames_decoded_max"], y["data/frames_decoded_max"]
        assert whole > 0 and frames <= whole / 2 + 2 * x["perf/videos"], (x["step"], frames, whole)


def _refused(args, procs=1) -> str:
    proc = run_cli(args, timeout=TIMEOUT_S, procs=procs)
    assert proc.returncode == 2, proc.stderr[-3000:]
    return proc.stderr


def test_bad_sequence_parallel_settings_are_one_line(grpo_data, tmp_path):
    err = _refused(_grpo(grpo_data, tmp_path, "bad1", **{"parallel.sequence_parallel_size": 3}))
    assert "parallel.sequence_parallel_size=3 does not divide the 1 launched ranks" in err
    err = _refused(_grpo(grpo_data, tmp_path, "bad2", **{"parallel.sequence_parallel_size": 0}))
    assert "parallel.sequence_parallel_size" in err and "must be >= 1" in err
    assert not (tmp_path / "bad1").exists() and not (tmp_path / "bad2").exists()


def test_heads_and_settings_that_cannot_run_under_sp(tmp_path):
    from mmpg.config import load_config
    from mmpg.errors import UserError
    from mmpg.train.setup import check_sequence_parallel

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen2_5_vl", "text_config": {"num_attention_heads": 6, "num_key_value_heads": 2}}))
    cfg = load_config(None, [f"model.path={tmp_path}", "parallel.sequence_parallel_size=4"])
    with pytest.raises(UserError, match="6 attention heads cannot be split over sequence_parallel_size=4"):
        check_sequence_parallel(cfg, 8)
    cfg = load_config(None, [f"model.path={tmp_path}", "parallel.sequence_parallel_size=2",
                             "algorithm.grouping=false"])
    with pytest.raises(UserError, match="needs algorithm.grouping=true"):
        check_sequence_parallel(cfg, 2)
    cfg = load_config(None, [f"model.path={tmp_path}", "parallel.sequence_parallel_size=2"])
    assert check_sequence_parallel(cfg, 4) == 2  # 2 data-parallel groups of 2
