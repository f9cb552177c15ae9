"""`mmpg plan`: the memory model's arithmetic on hand-computed cases, the parameter count against models built on the
meta device, the CLI's JSON and its one-line errors, the published points, and one measured CPU point."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mmpg.models.geometry import MODELS, Geometry, Vision, from_config_dict
from mmpg.plan.memory import layer_transient, per_token_layer, predict, states
from mmpg.plan.recipe import Recipe

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}
# h 8, 1 layer, 2/1 heads of 4, I 16, V 10, untied, Qwen2 biases
SMALL = Geometry("hand", hidden=8, layers=1, heads=2, kv_heads=1, intermediate=16, vocab=10)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_param_count_matches_the_model(family):
    import torch
    from transformers import AutoModelForImageTextToText

    from mmpg.bench.model import model_config

    config, _ = model_config({"family": family, "spec": TINY})
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    g = from_config_dict(config.to_dict(), family)
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    assert g.vision.params() == vision
    assert g.params() == sum(p.numel() for p in model.parameters())


def test_hand_counted_parameters_and_states():
    # layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, biases 8+4+4 = 16, MLP 3*8*16 = 384, norms 16 -> 608
    assert SMALL.layer_params() == 608
    # + embedding 80 + head 80 + final norm 8
    assert SMALL.params() == 776
    r = Recipe(SMALL, P=4, S=2, G=2, zero=0, world=4)
    # bf16 + fp32 master (4) + AdamW m, v (8): DeepSpeed's 16 bytes a trained parameter
    assert states(r) == {"weights": 2 * 776, "gradients": 2 * 776, "master": 4 * 776, "optimizer": 8 * 776,
                         "reference": 0.0, "cpu_offload": 0.0}
    z2 = states(dataclasses.replace(r, zero=2))
    assert (z2["weights"], z2["gradients"], z2["master"], z2["optimizer"]) == (2 * 776, 2 * 776 / 4, 776, 2 * 776)
    # ZeRO-3: each rank holds 1/4 of the weights and of the reference: 2 * 776 / 4 = 388 bytes each. DeepSpeed also
    # keeps tensors of <= stage3_param_persistence_threshold values whole (all of this model's) while a forward and
    # backward run, and partitions them again before the step; the plan does not count that copy: on one rank, a
    # model whose tensors are 96 % persistent (30.5 MB of 31.9) measured +16 MB after set-up and +10 MB after a step
    # above the partitions alone, not the +30.5 MB a whole copy would add (docs/plan.md, "What the CPU plan adds").
    z3 = states(dataclasses.replace(r, zero=3, reference="copy"))
    assert (z3["weights"], z3["reference"]) == (2 * 776 / 4, 2 * 776 / 4)
    assert z3["master"] == (4 + 8) * 776 / 4  # + ZeRO-3's two flat fp32 gradient buffers
    off = states(dataclasses.replace(r, zero=3, offload=True))
    assert off["optimizer"] == off["master"] == 0 and off["cpu_offload"] == (8 + 12 + 2) * 776 / 4
    assert off["weights"] == 2 * 608  # one gathered layer
    # float32 on a CPU: no separate master at ZeRO 0 or 3 (the weights are it), a cloned partition at ZeRO-1/2
    # (measured at ZeRO-3, 9.6M trained parameters: set-up held weights + 8 N_t / W, 73.6 MB, not 12 N_t / W)
    f32 = dataclasses.replace(r, b=4, mixed=False)
    assert states(f32)["master"] == 0 and states(f32)["optimizer"] == 8 * 776
    assert states(dataclasses.replace(f32, zero=2))["master"] == 4 * 776 / 4
    assert states(dataclasses.replace(f32, zero=3))["master"] == 8 * 776 / 4
    # LoRA r 2 on q,k,v,o,gate,up,down: 2 * ((8+8) + (8+4) + (8+4) + (8+8) + (8+16) + (8+16) + (16+8)) = 256
    assert SMALL.lora_params(2) == 256
    assert states(dataclasses.replace(r, lora_r=2))["optimizer"] == 8 * 256


def test_activation_terms_by_hand():
    # a = 4h + 3 Hq d + 2 Hkv d + 4 I = 32 + 24 + 8 + 64 = 128 values per token and layer
    assert per_token_layer(SMALL) == 128
    # no-grad live set: 2h + max(3I = 48, 3 Hq d + 4 Hkv d = 24 + 16) = 64 values per token
    assert layer_transient(SMALL, 10, 2) == 10 * 2 * 64


def test_cpu_terms_by_hand():
    """What the CPU plan adds (docs/plan.md), each on SMALL by hand, and none of it on a GPU."""
    from mmpg.plan.memory import (decode_bytes, dense_mask_bytes, frames_bytes, hooked_vision_bytes,
                                  optimizer_step_bytes)
    from mmpg.plan.recipe import RUNTIME_BYTES

    g = dataclasses.replace(SMALL, vision=Vision(hidden=4, intermediate=8, depth=1, patch=2, temporal_patch=2,
                                                 merge=2, out_hidden=8))
    # P 10 (6 video tokens: 24 patches of 3 * 2 * 2 * 2 = 24 values), G 2, S 2, float32 on the CPU
    r = Recipe(g, P=10, S=2, G=2, video_tokens=6, b=4, mixed=False, device="cpu")
    # the naive forward with padded rows: 2 rows x 12 x 12 pairs, a bool byte and a float32 copy each
    assert dense_mask_bytes(dataclasses.replace(r, grouped=False, ragged=True)) == 2 * 12 * 12 * (1 + 4)
    assert dense_mask_bytes(dataclasses.replace(r, grouped=False)) == 0  # no padding: no mask (the bench's rows)
    # frozen tower under checkpointing: 4 values of hv 4 a patch, 24 patches, one video (grouped), float32
    assert hooked_vision_bytes(dataclasses.replace(r, ckpt=True)) == 4 * 24 * 4 * 4
    # frames decoded in this process: as many float32 values as the pixel values (24 x 24); decoding: two more
    here = dataclasses.replace(r, decode_here=True)
    assert frames_bytes(here) == 24 * 24 * 4 and decode_bytes(here) == {"decode": 2 * 24 * 24 * 4}
    assert frames_bytes(r) == 0  # a DataLoader worker decoded them: not in this process
    # AdamW's two float32 temporaries of the largest trained tensor at ZeRO-0 (the MLP's 8 x 16), of the flat
    # partition at ZeRO-2 (776 LM parameters, the tower frozen), three with ZeRO-3's float32 gradient copy
    assert optimizer_step_bytes(r) == 2 * 4 * 8 * 16
    assert optimizer_step_bytes(dataclasses.replace(r, zero=2)) == 2 * 4 * 776
    assert optimizer_step_bytes(dataclasses.replace(r, zero=3)) == 3 * 4 * 776
    cpu = predict(dataclasses.replace(r, runtime=RUNTIME_BYTES, self_check=True, decode_here=True))
    assert cpu["parts"]["runtime"] == RUNTIME_BYTES and {"self_check", "decode"} <= set(cpu["phases"])
    # none of it on a GPU: the same recipe on "cuda" plans exactly what it planned without these fields
    gpu = dataclasses.replace(r, device="cuda", runtime=RUNTIME_BYTES, self_check=True, decode_here=True,
                              ragged=True, ckpt=True, grouped=False, decode="copy")
    plain = Recipe(g, P=10, S=2, G=2, video_tokens=6, b=4, mixed=False, ckpt=True, grouped=False, decode="copy")
    assert predict(gpu)["phases"] == predict(plain)["phases"]


def test_grouped_rows_and_kv_shrink_as_the_token_ratio():
    g = MODELS["qwen2.5-vl-7b"]
    r = Recipe(g, P=8192, S=256, G=8, video_tokens=8000, world=8, zero=2, ckpt=True)
    grouped, naive = predict(r), predict(dataclasses.replace(r, grouped=False, decode="copy"))
    assert naive["peak_bytes"] > grouped["peak_bytes"]
    from mmpg.plan.memory import kv_cache_bytes

    kv_c = kv_cache_bytes(r)
    assert kv_c == (8192 + 8 * 256) * 2 * 28 * 4 * 128 * 2  # tokens x (K and V) x layers x kv heads x d x bf16
    kv_n = kv_cache_bytes(dataclasses.replace(r, grouped=False, decode="copy"))
    assert kv_n / kv_c == pytest.approx(8 * (8192 + 256) / (8192 + 8 * 256))
    # checkpointing keeps one h per token and layer instead of a
    nockpt = predict(dataclasses.replace(r, ckpt=False))
    assert nockpt["parts"]["activations"] > 5 * grouped["parts"]["activations"]


def _plan_json(*args, capsys):
    from mmpg.cli import main

    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json_for_the_shipped_config(capsys):
    rc, out, _ = _plan_json("--config", "configs/grounding_qwen25vl_7b.yaml", "--gpus", "8", "--gpu", "a100-80",
                            "--json", capsys=capsys)
    assert rc == 0
    p = json.loads(out)
    assert {"peak_bytes", "parts", "step_seconds", "fits"} <= set(p)
    assert p["fits"] is True and p["zero"] == 2 and p["video_tokens"] == 8192
    assert p["peak_bytes"] == max(p["phases"].values())
    assert p["step_seconds"]["total"] > 0 and p["other_layout_step_seconds"] > p["step_seconds"]["total"]


def test_cli_what_fits_lists_changes_with_their_peaks(capsys):
    rc, out, _ = _plan_json("--config", "configs/grounding_qwen25vl_7b.yaml", "model.gradient_checkpointing=false",
                            "--gpus", "8", "--gpu", "a40", "--json", capsys=capsys)
    p = json.loads(out)
    assert rc == 0 and p["fits"] is False
    rows = {row["change"]: row for row in p["what_fits"]}
    assert rows["model.gradient_checkpointing=true"]["fits"]
    assert all(row["peak_bytes"] < p["peak_bytes"] for row in p["what_fits"] if "rollout.n" not in row["change"])


@pytest.mark.parametrize("args, words", [
    (["--config", "configs/grounding_qwen25vl_7b.yaml", "--gpu", "b200x"], "unknown GPU 'b200x'"),
    (["--config", "configs/cpu_demo.yaml", "model.path=/nonexistent/model"], "no config.json"),
    (["--config", "configs/grounding_qwen25vl_7b.yaml", "--gpus", "3", "parallel.sequence_parallel_size=2"],
     "must divide --gpus 3"),
    (["--config", "configs/grounding_qwen25vl_7b.yaml", "--gpu-memory", "0"], "--gpu-memory 0"),
])
def test_cli_bad_input_is_one_line_exit_2(args, words, capsys):
    rc, out, err = _plan_json(*args, capsys=capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err, err


def test_published_points():
    from mmpg.plan.published import published

    rows = {r["name"].split(",")[0].split(" ")[0]: r for r in published()}
    assert len(rows) == 4 and all(r["difference"] for r in rows.values())
    assert rows["Time-R1"]["fits"]  # reported: trains on one GPU
    alst = rows["8B"]
    assert not alst["fits"] and alst["fits_at_32k"]  # reported: out of memory past 32K tokens
    vc = rows["VideoChat-R1"]
    assert vc["planned_peak_bytes"] > 46 * 0.9 * 2 ** 30  # reported: fails on 46 GB
    assert not rows["Video-R1"]["fits"] and "more than" in rows["Video-R1"]["difference"]  # reported: OOM


def test_time_model_grouped_vs_naive():
    from mmpg.plan.timing import Throughput, step_seconds

    hw = Throughput("x", 312, 2.0)
    r = Recipe(MODELS["qwen2.5-vl-3b"], P=4096, S=256, G=8, video_tokens=4000)
    g, n = step_seconds(r, hw), step_seconds(dataclasses.replace(r, grouped=False, decode="copy"), hw)
    assert n["update"] / g["update"] == pytest.approx(
        __import__("mmpg.bench.flops", fromlist=["x"]).rho_flops(r.geometry, 4096, 256, 8,
                                                                    video_patches=16000, frame_patches=1024,
                                                                    train_vision=False), rel=1e-6)
    assert n["rollout_decode"] > g["rollout_decode"] and g["total"] == pytest.approx(
        sum(v for k, v in g.items() if k != "total"))


@pytest.mark.slow  # ~30 s on 2 busy cores: DeepSpeed's import and a warm-up step in a fresh process
def test_one_measured_cpu_point():
    """The smallest validation case, measured in its own process as `mmpg.plan.validate` does: within 25 %."""
    from mmpg.plan.validate import case, predict_case

    c = case("tiny", 0, 0, 4, 1024, False, "mmpg")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "mmpg.plan.validate", "--case", json.dumps(c)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])["peak_bytes"]
    predicted = predict_case(c)
    print(f"measured {measured / 2 ** 20:.1f} MB, predicted {predicted / 2 ** 20:.1f} MB")
    assert abs(predicted / measured - 1) < 0.25


def test_a_shared_video_is_held_once_for_its_queries():
    # P 10 = 6 video tokens + a 4-token tail; 4 queries of one video x G 2 x S 2 in one micro-batch:
    # update row 6 + 4*2*(4+2) = 54 tokens (per-query grouping: 4 * (10 + 2*2) = 56); K/V 6 + 4*(4 + 2*2) = 38 tokens
    from mmpg.plan.memory import kv_cache_bytes

    r = Recipe(SMALL, P=10, S=2, G=2, video_tokens=6, micro_groups=4, queries=4, prompts=4)
    assert r.update_tokens() == 54
    assert dataclasses.replace(r, queries=1).update_tokens() == 56
    per_token = 2 * SMALL.layers * SMALL.kv_heads * SMALL.d * r.b
    assert kv_cache_bytes(r) == 38 * per_token
    assert kv_cache_bytes(dataclasses.replace(r, queries=1)) == 4 * (10 + 4) * per_token


def test_run_plan_beside_its_measured_peak(tmp_path, capsys):
    """`mmpg plan --run`: the run's config.yaml planned, its largest perf/peak_memory_mb beside it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  path: qwen2.5-vl-3b\n  gradient_checkpointing: true\n"
                                     "trainer:\n  device: cuda\n  micro_batch_size: 8\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"v": 1, "step": s, "time": 0.0,
                                                           "perf/peak_memory_mb": mb}) + "\n"
                                               for s, mb in ((1, 30000.0), (2, 31000.5))))
    rc, out, _ = _plan_json("--run", str(run), "--gpus", "8", "--gpu", "h100", "--json", capsys=capsys)
    p = json.loads(out)
    assert rc == 0 and p["measured_peak_mb"] == 31000.5 and p["steps"] == 2
    assert p["plan"]["model"] == "Qwen2.5-VL-3B" and p["plan"]["devices"] == 8
    (run / "run.json").write_text(json.dumps({"layout_version": 1, "kind": "grpo", "device": "cuda", "devices": 4}))
    rc, out, _ = _plan_json("--run", str(run), "--json", capsys=capsys)  # the device count the run recorded
    assert rc == 0 and json.loads(out)["plan"]["devices"] == 4
    rc, _, err = _plan_json("--run", str(tmp_path), capsys=capsys)
    assert rc == 2 and "is not a run directory" in err and len(err.strip().splitlines()) == 1
    (run / "config.yaml").unlink()
    rc, _, err = _plan_json("--run", str(run), capsys=capsys)
    assert rc == 2 and "no config.yaml" in err and len(err.strip().splitlines()) == 1


def test_a_cpu_run_is_compared_only_when_it_measured_like_the_plan(tmp_path, capsys):
    """`mmpg plan --run` on a CPU run: an older run's whole-process ru_maxrss is shown and not divided by the plan;
    a run that recorded its measure (run.json "peak_memory", `mmpg.train.peak_memory`) gets the ratio and the
    verdict against the plan's stated CPU error, from the record's first step on."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  path: qwen2.5-vl-3b\ntrainer:\n  device: cpu\n  micro_batch_size: 8\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"v": 1, "step": s, "time": 0.0, "perf/peak_memory_mb": mb})
                                               + "\n" for s, mb in ((1, 990000.0), (2, 41000.0))))
    info = {"layout_version": 1, "kind": "grpo", "device": "cpu", "devices": 1}
    (run / "run.json").write_text(json.dumps(info))
    rc, out, _ = _plan_json("--run", str(run), "--json", capsys=capsys)
    p = json.loads(out)
    assert rc == 0 and p["plan"]["device"] == "cpu" and not p["comparable"] and "ru_maxrss" in p["measured_means"]
    rc, out, _ = _plan_json("--run", str(run), capsys=capsys)
    assert rc == 0 and "not comparable" in out and "of the plan" not in out
    record = {"measure": "cpu.rss_above_baseline", "baseline_mb": 1000.0, "high_water": "VmHWM", "from_step": 2,
              "mmap_threshold": 64 << 10}
    (run / "run.json").write_text(json.dumps({**info, "peak_memory": record}))  # resumed by this mmpg at step 2
    rc, out, _ = _plan_json("--run", str(run), "--json", capsys=capsys)
    p = json.loads(out)
    planned = p["plan"]["peak_bytes"] / 2 ** 20
    assert p["comparable"] and p["measured_peak_mb"] == 41000.0 and p["steps"] == 1
    rc, out, _ = _plan_json("--run", str(run), capsys=capsys)
    within = "within" if abs(41000.0 / planned - 1) <= 0.235 else "outside"
    assert f"×{41000.0 / planned:.2f} of the plan, {within} its CPU error (±23.5%)" in out
    for threshold, banded in ((64 << 10, True), (1 << 20, False), (None, False)):  # the band: at 64 KiB only
        (run / "run.json").write_text(json.dumps({**info, "peak_memory": {**record, "mmap_threshold": threshold}}))
        rc, out, _ = _plan_json("--run", str(run), capsys=capsys)
        assert rc == 0 and f"×{41000.0 / planned:.2f} of the plan" in out
        assert ("its CPU error (±23.5%)" in out) == banded, out
        assert ("is stated at a 64 KiB allocator threshold only" in out) == (not banded), out


def test_the_record_names_match_the_trainer():
    """The reader's name for the CPU measure is the one the trainer writes (kept apart: readers import no trainer)."""
    from mmpg.plan.run import CPU_ABOVE_BASELINE
    from mmpg.train.peak_memory import CPU_ABOVE_BASELINE as WRITTEN

    assert CPU_ABOVE_BASELINE == WRITTEN


def test_vllm_servers_memory_by_hand():
    """A server's parts for Qwen2.5-VL-7B, 2 prompts a rank of P 1000 (900 video tokens), G 8, S 100, bf16:
    K/V per token 2 x 28 layers x 4 kv heads x 128 x 2 B = 57,344 B; a prompt holds 1008 (63 blocks of 16) + 8 x 112
    tokens, its G samples sharing the prompt's blocks; the encoder cache one video's 900 merged embeddings of 3584."""
    from mmpg.models.geometry import MODELS
    from mmpg.plan.recipe import Recipe
    from mmpg.plan.serving import server_parts, server_plan, utilization

    g = MODELS["qwen2.5-vl-7b"]
    r = Recipe(geometry=g, P=1000, S=100, G=8, video_tokens=900, prompts=2)
    one = server_parts(r, ranks_per_server=1)
    assert one["weights"] == g.params() * 2
    assert one["kv_cache"] == 2 * (1008 + 8 * 112) * 57_344
    assert one["encoder_cache"] == 2 * 900 * 3584 * 2
    two = server_parts(r, ranks_per_server=2, tp=2)  # twice the batch over two GPUs: K/V the same per GPU
    assert two["kv_cache"] == one["kv_cache"] and two["weights"] == one["weights"] / 2
    assert utilization({"all": 0.26 * 80e9}, 80e9) == 0.3 and utilization({"all": 1e9}, 80e9) == 0.1
    plan = server_plan(r, trainer_peak=50e9, gpu_memory=80e9, budget=72e9, train_ranks=8)
    assert plan["colocated"]["servers"] == 8 and plan["separate"]["ranks_per_server"] == 2
    assert plan["colocated"]["fits"] == (50e9 + plan["colocated"]["gpu_memory_utilization"] * 80e9 + 1.5 * 2 ** 30
                                         <= 72e9)


def test_plan_prints_the_vllm_servers_and_the_colocated_share(capsys):
    """`mmpg plan` of a vllm config on GPUs prints both layouts; --vllm-mem prints the share the launch script uses."""
    base = ["--config", "configs/grounding_qwen25vl_7b.yaml", "rollout.engine=vllm", "--gpus", "8", "--gpu", "h100"]
    rc, out, _ = _plan_json(*base, capsys=capsys)
    assert rc == 0 and "colocated: 8 servers, one on each training GPU" in out and "separate: 4 server(s)" in out
    rc, share, _ = _plan_json(*base, "--vllm-mem", capsys=capsys)
    assert rc == 0 and 0.1 <= float(share) <= 0.9 and f"gpu_memory_utilization {float(share):.2f} (VLLM_MEM)" in out
    rc, _, err = _plan_json(*base[:2], "--gpus", "8", "--vllm-mem", capsys=capsys)
    assert rc == 2 and "--vllm-mem plans the vLLM servers" in err


def test_a_zoom_config_plans_its_longest_trajectory():
    """data.template=zoom: each response row is the longest trajectory (max_turns + 1 model turns, max_turns clips of
    zoom.max_frames frames at data.max_pixels), so the plan's responses and its peak grow with the tool's settings."""
    from mmpg.config import load_config
    from mmpg.plan.memory import predict
    from mmpg.plan.recipe import ZOOM_TURN_TEXT, recipe_from_config

    base = ["data.max_pixels=200704", "rollout.max_new_tokens=256"]
    one = recipe_from_config(load_config("configs/grounding_qwen25vl_7b.yaml", base), 8)
    zoom = recipe_from_config(load_config("configs/grounding_qwen25vl_7b.yaml", base + [
        "data.template=zoom", "zoom.max_frames=32", "zoom.max_turns=2"]), 8)
    clip = 32 // 2 * 200704 // 28 ** 2  # 16 temporal patches of 256 tokens
    assert one.S == 256 and zoom.S == 3 * 256 + 2 * (clip + ZOOM_TURN_TEXT)
    assert predict(zoom)["peak_bytes"] > predict(one)["peak_bytes"]
