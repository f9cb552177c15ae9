"""`mmpg bench --levels rollout` with the vLLM engine (`mmpg.bench.rollout_vllm`): when the variant is planned, why
a row is skipped, a server that dies, and the prompts and frames it sends. The fast tests start no server; the one
marked `vllm` runs the variant end to end (timings are never asserted: benchmarks are programs, not tests)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from mmpg.bench import batch, cli, rollout_vllm, runner, tables

# head_dim 32 (hidden 64 / 2 heads): the smallest vLLM serves; 2 frames 56x56 -> 1 x 4 x 4 patches, 4 video tokens
TINY_VL = {"level": "rollout", "P": 20, "S": 3, "G": 2, "B": 2, "family": "qwen2_5_vl", "dtype": "float32",
           "video": [2, 56, 56], "spec": {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                                          "intermediate_size": 64}}


def _args(preset, *, levels=None, family="qwen2", variants=None, vllm=False, url=None, checkpoint=None):
    return argparse.Namespace(preset=preset, levels=levels, family=family, P=None, S=None, G=None, variants=variants,
                              vllm=vllm, vllm_url=url, vllm_checkpoint=checkpoint)


def test_vllm_variant_is_planned_only_when_asked():
    # opt-in: the plain rollout plans never start a server
    (plain,) = cli.planned_configs(_args("cpu-targets", levels=["rollout"]))
    assert "vllm" not in plain["variants"] and "vllm_url" not in plain
    (flagged,) = cli.planned_configs(_args("cpu-targets", levels=["rollout"], vllm=True))
    assert flagged["variants"] == ["hf_generate", "mmpg:copy", "mmpg:cascade", "vllm"]
    # vllm in --variants asks for it too, and filters the rest as --variants always does
    (named,) = cli.planned_configs(_args("rollout-cpu", variants=["hf_generate", "vllm"]))
    assert named["variants"] == ["hf_generate", "vllm"]
    # --vllm-url implies --vllm and travels in the config; other levels never get the variant
    planned = cli.planned_configs(_args("cpu-targets", levels=["model", "rollout"], url="http://127.0.0.1:9"))
    assert [c["level"] for c in planned] == ["model", "rollout"]
    assert "vllm" not in planned[0]["variants"] and "vllm_url" not in planned[0]
    assert planned[1]["variants"][-1] == "vllm" and planned[1]["vllm_url"] == "http://127.0.0.1:9"


def test_vllm_presets():
    (cpu,) = cli.planned_configs(_args("rollout-vllm-cpu"))
    assert (cpu["family"], cpu["B"], cpu["G"], cpu["S"], cpu["video"]) == ("qwen2_5_vl", 2, 8, 32, [8, 112, 112])
    assert cpu["variants"] == ["hf_generate", "mmpg:copy", "mmpg:cascade", "vllm"]
    assert runner.shape_of(cpu)["P"] == 102 and runner.shape_of(cpu)["grid"] == (4, 8, 8)
    assert rollout_vllm.skip_reason(cpu, python="/some/python") is None  # head_dim 64: servable
    (gpu,) = cli.planned_configs(_args("rollout-vllm-gpu"))
    assert gpu["family"] == "qwen2_5_vl" and gpu["dtype"] == "bfloat16" and gpu["variants"][-1] == "vllm"


def test_skip_reasons():
    servable = dict(TINY_VL, variants=["vllm"])
    assert rollout_vllm.skip_reason(servable, python=None) == "skipped: no .venv-vllm (bash scripts/env.sh vllm)"
    assert rollout_vllm.skip_reason(servable, python="/some/python") is None
    assert rollout_vllm.skip_reason(dict(servable, vllm_url="http://127.0.0.1:9"), python=None) is None
    small = dict(servable, spec=dict(servable["spec"], num_heads=4))  # head_dim 16
    assert rollout_vllm.skip_reason(small, python="/p").startswith("skipped: head_dim 16 < 32")
    text = dict(servable, family="qwen2", video=None)
    assert "text model" in rollout_vllm.skip_reason(text, python="/p")
    assert rollout_vllm.skip_reason(dict(servable, family="qwen3_vl"), python="/p").startswith(
        "skipped: vllm variant needs --family qwen2_5_vl")


def test_checkpoint_of_another_size_is_refused(tmp_path):
    config = dict(TINY_VL, variants=["vllm"])
    rollout_vllm.save_served_model(config, tmp_path / "same")
    assert rollout_vllm.checkpoint_mismatch(config, tmp_path / "same") is None
    wider = dict(config, spec=dict(config["spec"], hidden_size=128, num_heads=4))
    assert rollout_vllm.checkpoint_mismatch(wider, tmp_path / "same") == "hidden_size 64 vs 128"
    assert rollout_vllm.skip_reason(dict(wider, vllm_checkpoint=str(tmp_path / "same")), python="/p") == (
        "skipped: --vllm-checkpoint is not the config's model (hidden_size 64 vs 128)")


def test_without_venv_the_vllm_row_says_skipped_and_the_rest_runs(monkeypatch):
    from mmpg.serve import launch

    monkeypatch.setattr(launch, "vllm_python", lambda: None)
    config = dict(TINY_VL, variants=["hf_generate", "mmpg:cascade", "vllm"])
    rows = runner.add_ratios(runner.run_config(config, rounds=1, warmup=1, repeats=1, timeout=60, max_gb=12,
                                               in_process=True, log=lambda m: None))
    by = {r["variant"]: r for r in rows}
    for name in ("hf_generate", "mmpg:cascade"):  # B = 2 prompts, each with its G rows
        assert by[name]["note"] == "" and by[name]["time_s"] > 0
    assert by["mmpg:cascade"]["tokens"] == 2 * (by["mmpg:cascade"]["P"] + 2 * 3)
    assert by["vllm"]["note"] == "skipped: no .venv-vllm (bash scripts/env.sh vllm)"
    assert by["vllm"].get("time_s") is None and by["vllm"]["speedup"] is None
    table = tables.rollout_table(rows)
    assert "skipped: no .venv-vllm (bash scripts/env.sh vllm)" in table and "vLLM's own kernels" in table


def test_a_server_that_dies_is_an_error_row_with_its_log(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no such model: boom'\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MMPG_VLLM_PYTHON", str(fake))
    messages = []
    (row,) = runner.run_config(dict(TINY_VL, variants=["vllm"]), rounds=1, warmup=1, repeats=1, timeout=60,
                               max_gb=12, in_process=True, log=messages.append)
    assert row["note"].startswith("error: vLLM server exited (3): no such model: boom (log: "), row["note"]
    log = Path(row["note"].rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.is_file() and "boom" in log.read_text()  # kept for reading, its path printed
    assert any(str(log) in m for m in messages)
    log.unlink()


def test_prompts_and_frames_match_the_video_grid():
    from mmpg.bench.batch import TEXT_IDS
    from mmpg.bench.model import build_model

    model, ids = build_model(TINY_VL, torch.device("meta"))  # what the worker builds: no weights
    prompt, info = batch.make_batch(model, TINY_VL, ids, torch.device("cpu"))
    assert prompt["input_ids"].shape == (2, info["P"]) and info["video_tokens"] == 4
    assert not torch.equal(prompt["input_ids"][0], prompt["input_ids"][1])  # two prompts, not one twice
    assert prompt["video_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    videos = rollout_vllm.videos_for(prompt, model.config.vision_config)
    assert [tuple(f.shape) for f, _ in videos] == [(2, 3, 56, 56)] * 2  # the processor's grid without resizing
    assert videos[0][1] == {"fps": 2.0, "total_num_frames": 2, "frames_indices": [0, 1]}
    same, _ = rollout_vllm._fresh(prompt, videos, 0, TEXT_IDS)
    later, later_videos = rollout_vllm._fresh(prompt, videos, 5, TEXT_IDS)
    assert same is prompt
    assert torch.equal(later["input_ids"][:, 1:], prompt["input_ids"][:, 1:])
    assert torch.equal(later["input_ids"][:, 0], (prompt["input_ids"][:, 0] + 5) % TEXT_IDS)
    assert not torch.equal(later_videos[0][0], videos[0][0])


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_variant_end_to_end(monkeypatch):
    # a real server on a saved copy of the config's model (head_dim 64, as tests/test_vllm_engine.py uses)
    from vllm_server import IN_PROCESS, need_vllm

    need_vllm()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    for key, value in IN_PROCESS.items():  # the bench's server in one process, as the tests' own servers run
        monkeypatch.setenv(key, value)
    config = dict(TINY_VL, spec={"hidden_size": 256, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
                                 "intermediate_size": 256}, variants=["hf_generate", "mmpg:cascade", "vllm"])
    messages = []
    rows = runner.add_ratios(runner.run_config(config, rounds=1, warmup=1, repeats=1, timeout=900, max_gb=12,
                                               in_process=True, log=messages.append))
    by = {r["variant"]: r for r in rows}
    assert by["vllm"]["note"] == "", "\n".join(messages)
    assert by["vllm"]["time_s"] > 0 and by["vllm"]["speedup"] > 0 and by["vllm"]["peak_MB"] is None
    assert by["vllm"]["vllm_server"]["start_s"] > 0
    print("\n" + tables.rollout_table(rows))


def test_a_url_without_server_is_an_error_row():
    (row,) = runner.run_config(dict(TINY_VL, variants=["vllm"], vllm_url="http://127.0.0.1:9"), rounds=1,
                               warmup=1, repeats=1, timeout=60, max_gb=12, in_process=True, log=lambda m: None)
    assert row["note"].startswith("error: no vLLM server at --vllm-url http://127.0.0.1:9"), row["note"]
