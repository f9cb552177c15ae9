"""LoRA runs end to end, each in a fresh process as a user starts it: GRPO with grouping true vs false trains the same
adapters (also with a KL term, whose adapters-off reference equals a separately loaded frozen base), a SIGKILLed run
resumes to the uninterrupted result, two ZeRO-3 ranks train what one process trains, SFT saves an adapter
checkpoint, and bad LoRA settings are one line with exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from train_utils import metrics, overrides, run_cli

LOSS_RTOL = 1e-5  # per-step loss and KL, as tests/test_train_grpo.py: |a - b| <= LOSS_RTOL * max(|a|, |b|, 1)
WEIGHT_RTOL = 1e-5  # relative norm of the final adapter difference
LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "optim.lr": 1e-2}


def adapter(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / "adapter_model.safetensors"))


def rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a)
    return (num / sum(float((a[k].double() ** 2).sum()) for k in a)) ** 0.5


def _train(args, timeout=600, procs=1):
    proc = run_cli(args, timeout=timeout, procs=procs)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _same_losses(a: list[dict], b: list[dict], kl: bool = False) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for ma, mb in zip(a, b):
        assert ma["reward/mean"] == mb["reward/mean"], "both runs must sample the same responses"
        for key in ("actor/loss",) + (("actor/kl",) if kl else ()):
            x, y = ma[key], mb[key]
            assert abs(x - y) <= LOSS_RTOL * max(abs(x), abs(y), 1.0), (ma["step"], key, x, y)


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.1], ids=["beta0", "beta"])
def test_grouped_and_repeated_lora_training_are_the_same(grpo_data, tmp_path, beta):
    """5 steps, grouping true vs false: same losses and final adapters. With beta > 0 also a third run whose
    reference is a copy of the base checkpoint loaded as a separate frozen model (model.ref_path): the same KL as
    the adapters-off reference, so the same training."""
    runs = {}
    for name, extra in [("g1", {}), ("g0", {"algorithm.grouping": False})]:
        _train(["train"] + overrides(grpo_data, tmp_path, name, **{**LORA, "trainer.total_steps": 5,
                                                                    "algorithm.beta": beta, **extra}))
        runs[name] = tmp_path / name
    a, b = metrics(runs["g1"]), metrics(runs["g0"])
    assert any(abs(m["actor/loss"]) > 0 for m in a)
    _same_losses(a, b, kl=beta > 0)
    # the HF rollout engine (cascade decoding) samples through the same adapters the grouped forward trains
    assert all(m["actor/logprob_gap_max"] <= 1e-4 for m in a), [m["actor/logprob_gap_max"] for m in a]
    diff = rel(adapter(runs["g1"], 5), adapter(runs["g0"], 5))
    print(f"beta={beta}: max loss diff {max(abs(x['actor/loss'] - y['actor/loss']) for x, y in zip(a, b)):.2e}, "
          f"max kl diff {max(abs(x['actor/kl'] - y['actor/kl']) for x, y in zip(a, b)):.2e}, adapters {diff:.2e}")
    assert diff <= WEIGHT_RTOL, f"final adapters differ by {diff:.2e} (relative norm)"
    assert max(float(v.abs().max()) for k, v in adapter(runs["g1"], 5).items() if "lora_B" in k) > 1e-3, \
        "lora_B starts at 0 and must move"
    info = json.loads((runs["g1"] / "run.json").read_text())["parameters"]
    assert info["lora"]["modules"] == 14 and info["trainable"] == 8192, info  # 2 layers x 7 projections, r=4
    if beta == 0:
        return
    assert all(m["actor/kl"] > 1e-7 for m in a[1:]), "the adapters move away from the base after step 1"
    copy = shutil.copytree(grpo_data["model"], tmp_path / "base_copy")
    _train(["train"] + overrides(grpo_data, tmp_path, "ref", **{**LORA, "trainer.total_steps": 5,
                                                                 "algorithm.beta": beta, "model.ref_path": str(copy)}))
    c = metrics(tmp_path / "ref")
    _same_losses(a, c, kl=True)
    diff = rel(adapter(runs["g1"], 5), adapter(tmp_path / "ref", 5))
    print(f"adapters-off vs loaded base: kl {[m['actor/kl'] for m in a]} vs {[m['actor/kl'] for m in c]}, "
          f"adapters {diff:.2e}")
    assert diff <= WEIGHT_RTOL, f"adapters-off vs loaded reference: final adapters differ by {diff:.2e}"


@pytest.mark.slow
def test_lora_sigkill_then_resume_matches_an_uninterrupted_run(grpo_data, tmp_path):
    from test_train_resume import STEPS, _args, _kill_after_step, _rollouts, _stable

    def args(name):
        return _args(grpo_data, tmp_path, name) + [f"{k}={v}" for k, v in LORA.items() if k != "optim.lr"] + \
            ["algorithm.beta=0.05"]

    _train(args("straight"))
    run = tmp_path / "killed"
    _kill_after_step(args("killed"), run, 5)
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] < STEPS
    proc = _train(args("killed")[:1] + ["--resume", "auto"] + args("killed")[1:])
    assert "resumed from" in proc.stderr and "step_00000004" in proc.stderr
    straight, resumed = metrics(tmp_path / "straight"), metrics(run)
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1)), "a step was lost or repeated"
    for x, y in zip(straight, resumed):
        assert _stable(x) == _stable(y), x["step"]
    assert _rollouts(tmp_path / "straight") == _rollouts(run)
    assert rel(adapter(tmp_path / "straight", STEPS), adapter(run, STEPS)) == 0.0
    ckpt = run / "checkpoints" / f"step_{STEPS:08d}"
    assert not (ckpt / "model.safetensors").exists(), "a LoRA checkpoint holds the adapter, not the full weights"
    proc = run_cli(args("killed")[:1] + ["--resume", str(ckpt)] + [a for a in args("killed")[1:]
                                                                  if not a.startswith("model.lora.r=")])
    assert proc.returncode == 2 and "saved with LoRA adapters" in proc.stderr, proc.stderr[-2000:]
    # other adapters (fewer target modules, another rank) would load some tensors and leave the rest fresh: refused
    for change, words in (("model.lora.target_modules=[q_proj,v_proj]", "target_modules: 14 there, 4 here"),
                          ("model.lora.r=8", "r 4 there, 8 here")):
        proc = run_cli(args("killed")[:1] + ["--resume", str(ckpt)] + args("killed")[1:] + [change])
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]


DIST_EXTRA = {"model.lora.r": 4, "model.lora.alpha": 8, "algorithm.beta": 0.1}


@pytest.fixture(scope="module")
def lora_single(grpo_data, tmp_path_factory):
    from test_train_distributed import RUN_TIMEOUT_S, _args

    out = tmp_path_factory.mktemp("lora_single")
    _train(_args(grpo_data, out, "one", **DIST_EXTRA), timeout=RUN_TIMEOUT_S)
    return out / "one"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_two_ranks_match_one_process(grpo_data, tmp_path, lora_single, stage):
    """ZeRO-2, and ZeRO-3 with every parameter partitioned, KL against the adapters-off forward (a forward every
    rank runs in lockstep) and a held-out evaluation: two ranks train the adapters one process trains."""
    from test_train_distributed import LOSS_ATOL, NORM_RTOL, RUN_TIMEOUT_S, ZERO3, _args, _check_heldout_equal

    extra = {"deepspeed.zero_stage": stage}
    if stage == 3:
        config = tmp_path / "zero3.json"
        config.write_text(json.dumps(ZERO3))
        extra = {"deepspeed.config": str(config)}
    _train(_args(grpo_data, tmp_path, "two", **DIST_EXTRA, **extra), timeout=RUN_TIMEOUT_S, procs=2)
    one, two = metrics(lora_single), metrics(tmp_path / "two")
    assert [m["step"] for m in two] == [1, 2, 3]
    for a, b in zip(two, one):
        assert a["reward/mean"] == b["reward/mean"], "the ranks must sample what one process samples"
        assert abs(a["actor/loss"] - b["actor/loss"]) <= LOSS_ATOL
        assert abs(a["actor/kl"] - b["actor/kl"]) <= LOSS_ATOL
        assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) <= NORM_RTOL * b["actor/grad_norm"], \
            (a["step"], a["actor/grad_norm"], b["actor/grad_norm"])
    assert one[-1]["actor/kl"] > 0, "the adapters-off reference must differ from the trained policy"
    _check_heldout_equal(tmp_path / "two", lora_single)
    diff = rel(adapter(tmp_path / "two", 3), adapter(lora_single, 3))
    print(f"ZeRO-{stage}: max loss diff {max(abs(a['actor/loss'] - b['actor/loss']) for a, b in zip(two, one)):.2e}, "
          f"max grad-norm rel diff "
          f"{max(abs(a['actor/grad_norm'] / b['actor/grad_norm'] - 1) for a, b in zip(two, one)):.2e}, "
          f"adapters {diff:.2e}")
    assert diff <= WEIGHT_RTOL, f"final adapters differ by {diff:.2e} (relative norm)"
    info = json.loads((tmp_path / "two" / "run.json").read_text())
    assert info["parameters"]["trainable"] == 8192
    assert (info["device"], info["devices"]) == ("cpu", 2)  # what the inspector plans the run on


@pytest.mark.slow
def test_sft_with_lora_saves_an_adapter_checkpoint(grpo_data, tmp_path):
    args = ["sft"] + overrides(grpo_data, tmp_path, "sft", **{
        **LORA, "trainer.total_steps": 4, "trainer.micro_batch_size": 1, "checkpoint.every_n_steps": 2,
        "reward.function": "", "model.gradient_checkpointing": True})
    proc = _train(args)
    assert "trainable parameters: 8.2K of 257.2K (3.2 %), LoRA r=4 on 14 modules" in proc.stderr
    lines = metrics(tmp_path / "sft")
    assert [m["step"] for m in lines] == [1, 2, 3, 4] and lines[-1]["sft/loss"] < lines[0]["sft/loss"]
    ckpt = tmp_path / "sft" / "checkpoints" / "step_00000004"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "trainer_state.json",
            "COMPLETE"} <= names and "model.safetensors" not in names, names
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(grpo_data["model"]).resolve())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert all(t.startswith("model.language_model.") for t in config["target_modules"])
    weights = adapter(tmp_path / "sft", 4)
    assert len(weights) == 28 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in weights)
    assert max(float(v.abs().max()) for k, v in weights.items() if "lora_B" in k) > 0
    # peft loads it onto the base named in the checkpoint and gets the saved tensors back
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    loaded = dict(PeftModel.from_pretrained(base, str(ckpt)).named_parameters())
    for k, v in weights.items():
        assert torch.equal(loaded[k.replace(".weight", ".default.weight")], v), k


@pytest.mark.slow
def test_lora_dropout_trains_past_the_self_check(grpo_data, tmp_path):
    """model.lora.dropout > 0 with the self-check on (the default) and a KL term: the self-check and the reference
    logprobs run without dropout (`without_dropout`), so the check passes at its float32 bound and training goes on."""
    _train(["train"] + overrides(grpo_data, tmp_path, "drop", **{**LORA, "model.lora.dropout": 0.3,
                                                                  "trainer.total_steps": 2, "algorithm.beta": 0.1}))
    lines = metrics(tmp_path / "drop")
    assert [m["step"] for m in lines] == [1, 2]
    checked = [m for m in lines if "check/grouped_vs_repeated_max" in m]
    assert checked and all(m["check/grouped_vs_repeated_max"] <= m["check/bound"] == 1e-4 for m in checked)
    assert all(abs(m["actor/loss"]) < 1e3 and m["actor/kl"] >= 0 for m in lines)


@pytest.mark.parametrize("extra, words", [
    ({"model.lora.r": -1}, ["'model.lora.r' is -1", ">= 0"]),
    ({"model.lora.r": 4, "model.lora.target_modules": "[q_proj,qkv_proj]"}, ["'qkv_proj' matches no module"]),
    ({"model.lora.r": 4, "model.lora.target_modules": "[q_proj,visual.merger.mlp.0]"},
     ["names vision-tower modules", "model.freeze_vision"]),
    ({"model.path": "ADAPTER"}, ["is a LoRA adapter checkpoint, not a model", "mmpg export"]),
], ids=["negative_r", "no_match", "vision_frozen", "adapter_as_model"])
def test_bad_lora_settings_are_one_line(grpo_data, tmp_path, extra, words):
    if extra.get("model.path") == "ADAPTER":  # what a LoRA checkpoint folder holds instead of config.json
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "adapter_config.json").write_text("{}")
        extra = {"model.path": str(tmp_path / "ckpt")}
    proc = run_cli(["train"] + overrides(grpo_data, tmp_path, "bad", **extra), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mmpg: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "bad").exists(), "nothing is written before the error"
