"""The shipped configs as recipes: every config under configs/ loads and passes its documented launch's GPU layout
check; `mmpg plan` on each 7B/8B config at its documented GPU count (the SFT one planned as an SFT step, checked by
hand); docs/training.md's table of the published recipes and docs/plan.md's plan table equal the configs and the
plan; the two settings added for the recipes (`model.train_merger`, `optim.scheduler: linear`); and
scripts/sft_grounding.sh's default config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from mmpg.config import load_config
from mmpg.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml"))
GIB = 2 ** 30
LAUNCH = re.compile(r"^#\s+NUM_GPUS=(\d+) bash scripts/(train|sft)_grounding\.sh (\S+)", re.M)


def _name(p: Path) -> str:
    return str(p.relative_to(ROOT / "configs"))


def _launch(path: Path) -> tuple[int, str] | None:
    """(GPUs, job) of the launch the config's header documents for itself, or None."""
    rel = str(path.relative_to(ROOT))
    found = [(int(n), job) for n, job, cfg in LAUNCH.findall(path.read_text()) if cfg == rel]
    assert len(found) <= 1, found
    return found[0] if found else None


BIG = [p for p in CONFIGS if _launch(p)]


def test_the_recipes_and_the_7b_configs_document_a_launch():
    assert {_name(p) for p in BIG} == {"grounding_qwen25vl_7b.yaml", "grounding_qwen25vl_7b_long.yaml",
                                       "grounding_qwen3vl_8b.yaml", "sft_qwen25vl_7b.yaml",
                                       "recipes/time_r1_charades.yaml", "recipes/videochat_r1_charades.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=_name)
def test_every_config_loads_validates_and_passes_its_launch_layout(path):
    from mmpg.train.layout import Ranks, check_layout

    cfg = load_config(str(path), [])  # defaults <- YAML, then the value checks (mmpg.config.checks)
    launch = _launch(path)
    if launch is None:
        return
    gpus, job = launch
    line = check_layout(cfg, job, Ranks(gpus, f"NUM_GPUS={gpus}"))
    assert line.startswith(f"{gpus} training rank(s) (NUM_GPUS={gpus}); data.batch_size={cfg.data.batch_size} = ")
    assert job == ("sft" if "sft" in yaml.safe_load(path.read_text()) else "train")


def _plan(capsys, *args) -> dict:
    from mmpg.cli import main

    assert main(["plan", *args, "--gpu", "a100-80", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("path", BIG, ids=_name)
def test_plan_fits_each_big_config_at_its_documented_launch(path, capsys):
    """On 80 GB GPUs (72 usable) at the launch's GPU count, as the plan's own memory model computes it."""
    from mmpg.plan.memory import predict
    from mmpg.plan.recipe import recipe_from_config
    from mmpg.plan.whole import sft_config

    gpus, job = _launch(path)
    p = _plan(capsys, "--config", str(path), "--gpus", str(gpus))
    assert p["job"] == job and p["devices"] == gpus
    assert p["budget_bytes"] == int(0.9 * 80 * GIB)
    cfg = load_config(str(path), [])
    r = recipe_from_config(sft_config(cfg, []) if job == "sft" else cfg, gpus)
    assert p["peak_bytes"] == predict(r, rollout=job == "train")["peak_bytes"]
    assert p["fits"] is True and p["peak_bytes"] <= p["budget_bytes"]


def test_sft_plan_by_hand(capsys):
    """configs/sft_qwen25vl_7b.yaml on 8 GPUs: one 40-token target per prompt, the update phase alone (before: a
    GRPO step of 8 responses with a rollout)."""
    from mmpg.models.geometry import MODELS

    p = _plan(capsys, "--config", "configs/sft_qwen25vl_7b.yaml", "--gpus", "8")
    assert (p["job"], p["G"], p["S"], p["P"], p["video_tokens"]) == ("sft", 1, 40, 8192 + 120, 8192)
    assert set(p["phases"]) == {"update"} and p["peak_phase"] == "update"
    g = MODELS["qwen2.5-vl-7b"]
    # the merger trains with the LM (model.train_merger): LN 1280 + (5120 x 5120 + 5120) + (5120 x 3584 + 3584)
    merger = 1280 + 5120 * 5120 + 5120 + 5120 * 3584 + 3584
    assert merger == g.vision.merger_params() == 44_574_464
    n, nt = g.params(), g.params() - g.vision.params() + merger
    assert (p["params"], p["trainable_params"]) == (n, nt)
    parts = p["parts"]
    # ZeRO-2 over 8 ranks, bf16 with an fp32 master: weights whole, gradients / master / AdamW m, v sharded
    assert parts["weights"] == 2 * n and parts["gradients"] == -(-2 * nt // 8)
    assert parts["master"] == -(-4 * nt // 8) and parts["optimizer"] == -(-8 * nt // 8)
    assert p["peak_bytes"] == pytest.approx(sum(parts.values()), abs=len(parts))
    assert "kv_cache" not in parts and "reference" not in {k for k, v in parts.items() if v}
    # time: 16 prompts a rank, each a checkpointed update (4 forwards) of its 8352-token row; a forward ~2 N_lm T
    # FLOPs plus causal attention 2 L T^2 h; at 35 % of 312 TFLOP/s
    T, lm = 8312 + 40, g.lm_params() - g.vocab * g.hidden  # the embedding is a lookup
    hand = 16 * 4 * (2 * lm * T + 2 * g.layers * T * T * g.hidden) / (312e12 * 0.35)
    assert set(p["step_seconds"]) == {"update", "total"}
    assert p["step_seconds"]["total"] == p["step_seconds"]["update"] == pytest.approx(hand, rel=0.1)


def test_plan_job_flag_and_detection(capsys):
    from mmpg.cli import main

    seven_b = "configs/grounding_qwen25vl_7b.yaml"
    assert _plan(capsys, "--config", seven_b, "--gpus", "8")["job"] == "train"
    p = _plan(capsys, "--config", seven_b, "--gpus", "8", "--job", "sft")
    assert p["job"] == "sft" and (p["G"], p["S"]) == (1, 40) and set(p["phases"]) == {"update"}
    p = _plan(capsys, "--config", "configs/sft_qwen25vl_7b.yaml", "--gpus", "8", "--job", "train",
              "trainer.micro_batch_size=8")
    assert p["job"] == "train" and p["G"] == 8 and "rollout" in p["phases"]
    assert main(["plan", "--config", "configs/sft_qwen25vl_7b.yaml", "--gpus", "8"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("SFT step (mmpg sft): one target of S tokens per prompt, no rollout, no reference; "
                     "configs/sft_qwen25vl_7b.yaml has an sft: group, --job train plans it as a GRPO step")


def _table(path: Path, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after `heading`, header row first."""
    lines = path.read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[start:end]]
    return [rows[0]] + rows[2:]  # the header, then the rows after the |---| line


def _value(cell: str):
    return yaml.safe_load(cell.strip("`"))


def test_the_docs_recipe_table_equals_the_configs():
    header, *rows = _table(ROOT / "docs" / "training.md", "## Published recipes")
    assert header[1:4] == ["`grounding_qwen25vl_7b`", "Time-R1", "VideoChat-R1"]
    cfgs = [load_config(str(ROOT / "configs" / name), []) for name in (
        "grounding_qwen25vl_7b.yaml", "recipes/time_r1_charades.yaml", "recipes/videochat_r1_charades.yaml")]
    keys = [r[0].strip("`") for r in rows]
    # the settings the issue names are all there
    assert {"data.fps", "data.max_frames", "data.total_pixels", "rollout.max_new_tokens", "model.freeze_vision",
            "model.train_merger", "algorithm.beta", "rollout.n", "data.batch_size", "optim.lr"} <= set(keys)
    for key, row in zip(keys, rows):
        group, name = key.split(".")
        for cfg, cell, who in zip(cfgs, row[1:4], header[1:4]):
            assert _value(cell) == getattr(getattr(cfg, group), name), f"{key} of {who}: the table says {cell}"


def test_the_plan_docs_table_equals_the_plan(capsys):
    header, *rows = _table(ROOT / "docs" / "plan.md", "### An SFT step")
    assert header[:7] == ["config", "GPUs", "P (video)", "S", "per-GPU peak", "fits", "step s (estimate)"]
    assert len(rows) == 3
    for row in rows:
        config = "configs/" + row[0].split("`")[1]
        p = _plan(capsys, "--config", config, "--gpus", row[1])
        assert row[2] == f"{p['P']} ({p['video_tokens']})" and int(row[3]) == p["S"], row
        assert row[4] == f"{p['peak_bytes'] / GIB:.1f} GB" and row[5] == ("yes" if p["fits"] else "no"), row
        assert int(row[6]) == round(p["step_seconds"]["total"]), row


def test_linear_schedule_by_hand():
    from mmpg.train.engine import lr_lambda

    # transformers' get_linear_schedule_with_warmup without warm-up: (T - u) / T over T = 4 updates
    assert [lr_lambda(4, 0, "linear", 0.0)(u) for u in range(4)] == [1.0, 0.75, 0.5, 0.25]
    # 2 warm-up updates, then from 1 down to the floor 0.2 over the 4 left: 1 - 0.8 * k / 4
    f = lr_lambda(6, 2, "linear", 0.2)
    assert [f(u) for u in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4])
    assert load_config(None, ["optim.scheduler=linear"]).optim.scheduler == "linear"


def test_train_merger_is_refused_where_it_means_nothing():
    with pytest.raises(UserError, match="model.freeze_vision=false trains the whole tower already"):
        load_config(None, ["model.train_merger=true", "model.freeze_vision=false"])
    with pytest.raises(UserError, match="only the adapters train"):
        load_config(None, ["model.train_merger=true", "model.lora.r=8"])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_merger_params_match_the_model(family):
    from transformers import AutoModelForImageTextToText

    from mmpg.bench.model import model_config
    from mmpg.models.geometry import from_config_dict

    config, _ = model_config({"family": family, "spec": {"hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                                          "num_kv_heads": 2, "intermediate_size": 128}})
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    g = from_config_dict(config.to_dict(), family)
    assert g.vision.merger_params() == sum(p.numel() for p in model.model.visual.merger.parameters())


def test_train_merger_trains_the_merger_through_the_grouped_forward(tiny_dirs):
    """A frozen tower with model.train_merger: the grouped forward's loss reaches the merger and the language model,
    no other vision weight gets a gradient (before: the option did not exist, the merger froze with the tower)."""
    from batches import completions, vl_batch
    from mmpg.grouping import grouped_logprobs
    from mmpg.models.loading import load_policy, load_processor

    model = load_policy(tiny_dirs["qwen2_5_vl"], freeze_vision=True, train_merger=True)
    visual = model.model.visual
    assert all(p.requires_grad == n.startswith("merger.") for n, p in visual.named_parameters())
    inputs = vl_batch(load_processor(tiny_dirs["qwen2_5_vl"]), "qwen2_5_vl", [(4, 56, 56)])
    ids, mask = completions([2], [3, 5], model.config.text_config.vocab_size)
    grouped_logprobs(model, inputs, ids, mask, [2]).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in visual.merger.parameters())
    assert all(p.grad is None for n, p in visual.named_parameters() if not n.startswith("merger."))
    assert model.lm_head.weight.grad is not None
    frozen = load_policy(tiny_dirs["qwen2_5_vl"], freeze_vision=True)
    assert not any(p.requires_grad for p in frozen.model.visual.parameters())


def test_sft_script_runs_the_7b_sft_config_by_default(tmp_path):
    """Before, it fell back to train_grounding.sh's default, the GRPO config (lr 1e-6)."""
    from test_gpu_layouts import Machine

    m = Machine(tmp_path)
    res, started = m.launch(["scripts/sft_grounding.sh", "data.train=a"], NUM_GPUS="8", DRY_RUN="1")
    assert res.returncode == 0 and started == [], res.stderr
    assert res.stdout.splitlines()[-1] == (f"  trainer: {m.env['MMPG_DEEPSPEED']} --num_gpus 8 --module mmpg.cli sft "
                                           "--config configs/sft_qwen25vl_7b.yaml data.train=a")
    assert "data.batch_size=128 = 16 prompt(s) per rank" in res.stderr
