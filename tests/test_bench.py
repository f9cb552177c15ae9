"""Smoke tests of the benchmark harness at tiny sizes: it runs, the table and JSON have their shape, and the variants
it times compute the same thing. No timing is asserted (benchmarks are programs, not tests)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mmpg.bench import cli, runner, tables
from mmpg.errors import UserError

ROW_KEYS = {"level", "P", "S", "G", "variant", "time_s", "speedup", "pct_ceiling", "peak_MB", "mem_ratio", "rho_lin",
            "rho_attn", "rho_flops", "note", "config"}


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_tiny_preset_in_process_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.run(_args("--preset", "tiny", "--in-process", "--out", str(out))) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("level"))
    for column in ("time_s", "speedup", "%ceil", "peak_MB", "mem_ratio", "rho_lin", "rho_attn", "rho_flops"):
        assert column in header
    data = json.loads(out.read_text())
    assert {"preset", "rounds", "repeats", "warmup", "torch", "device"} <= set(data["meta"])
    rows = data["rows"]
    assert [(r["level"], r["variant"]) for r in rows] == [
        ("attention", "naive"), ("attention", "upstream"), ("attention", "mmpg"),
        ("model", "repeated"), ("model", "upstream"), ("model", "mmpg")]
    for row in rows:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["note"] == "" and row["time_s"] > 0 and row["speedup"] > 0
        # in one process a step reuses pages earlier variants left behind: memory is not measured, not "0 MB"
        assert row["peak_MB"] is None and row["mem_ratio"] is None
        assert row["mem_method"] == "not measured (in-process)"
        assert row["rho_lin"] > 1 and row["rho_attn"] > 1 and row["rho_flops"] > 1
    table = printed[printed.index(header):].splitlines()[2:]
    cols = header.split()
    for line in filter(None, table[:-1]):  # the last line is "wrote ..."
        cells = line.split()
        assert cells[cols.index("peak_MB")] == "n/a" and cells[cols.index("mem_ratio")] == "n/a", line
    baselines = [r for r in rows if r["variant"] in ("naive", "repeated")]
    assert all(r["speedup"] == 1 and r["pct_ceiling"] is None for r in baselines)
    assert not list(tmp_path.glob("*.tmp-*"))  # atomic write left nothing behind


def test_worker_processes_measure_memory(tmp_path):
    # the real path: one fresh process per variant, memory from the process's own high-water mark
    config = {"level": "attention", "P": 64, "S": 8, "G": 3, "heads": 2, "kv_heads": 1, "head_dim": 8,
              "dtype": "float32", "variants": ["naive", "mmpg"]}
    rows = runner.run_config(config, rounds=1, warmup=1, repeats=1, timeout=300, max_gb=12, log=lambda m: None)
    assert [r["variant"] for r in rows] == ["naive", "mmpg"]
    for row in rows:
        assert row["note"] == "", row["note"]
        assert row["peak_MB"] > 0 and len(row["times"]) == 1  # a fresh process's cold step always grows its RSS
        assert row["mem_method"] in ("VmHWM-after-clear_refs", "ru_maxrss")
    assert runner.add_ratios(rows)[1]["mem_ratio"] > 0


@pytest.mark.parametrize("clear_refs,rss,hwm,maxrss,peak", [
    # clear_refs resets VmHWM to the RSS at entry (100); the step's peak is what the high-water grew above it
    (True, [100, 100], 160, None, 60),
    (True, [100, 100], 100, None, None),  # no growth: the step ran in pages already held, its peak is unknown
    # no clear_refs: the process high-water (400 before, from setup) counts only if the step raised it
    (False, [100, 100], None, [400, 450], 350),
    (False, [100, 100], None, [400, 400], None),  # hidden under the setup's high-water: not a measurement
])
def test_cpu_peak_that_cannot_be_seen_is_none(monkeypatch, clear_refs, rss, hwm, maxrss, peak):
    from mmpg.bench import memory

    rss, maxrss = iter(rss), iter(maxrss or [0, 0])
    monkeypatch.setattr(memory, "rss", lambda: next(rss))
    monkeypatch.setattr(memory, "reset_hwm", lambda: clear_refs)
    monkeypatch.setattr(memory, "hwm", lambda: hwm)
    monkeypatch.setattr(memory, "maxrss", lambda: next(maxrss))
    with memory.measured(torch.device("cpu")) as mem:
        pass
    assert mem.peak == peak and mem.method == ("VmHWM-after-clear_refs" if clear_refs else "ru_maxrss")


def test_table_says_n_a_for_missing_memory():
    base = {"level": "attention", "P": 64, "S": 8, "G": 3, "variant": "naive", "time_s": 0.5, "speedup": 1.0,
            "rho_lin": 2.0, "rho_attn": 2.0, "rho_flops": 2.0}
    ran = dict(base, peak_MB=None, mem_ratio=None)
    skipped = dict(base, variant="mmpg", time_s=None, speedup=None, peak_MB=None, mem_ratio=None, note="skipped")
    measured = dict(base, variant="upstream", peak_MB=12.0, mem_ratio=1.5)
    lines = tables.format_table([ran, skipped, measured]).splitlines()[2:]
    cols = tables.format_table([]).splitlines()[0].split()
    cells = [line.split() for line in lines]
    assert [c[cols.index("peak_MB")] for c in cells] == ["n/a", "-", "12"]
    assert [c[cols.index("mem_ratio")] for c in cells] == ["n/a", "-", "1.50"]


def test_grid_dry_run_skips_configs_over_the_memory_limit(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = _args("--preset", "cpu-grid", "--dry-run", "--levels", "model", "--P", "8192", "--S", "512",
                 "--G", "4,16", "--out", str(out))
    assert cli.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    notes = {r["G"]: r["note"] for r in rows}
    assert "would be skipped" in notes[16] and "would be skipped" not in notes[4]
    assert "would be skipped" in capsys.readouterr().out


def test_skipped_config_says_why():
    config = {"level": "attention", "P": 64, "S": 8, "G": 3, "heads": 2, "kv_heads": 1, "head_dim": 8,
              "dtype": "float32", "variants": ["naive", "mmpg"]}
    rows = runner.run_config(config, rounds=1, warmup=1, repeats=1, timeout=60, max_gb=1e-9, log=lambda m: None)
    assert all(r["note"].startswith("skipped: naive needs") for r in rows)
    assert "skipped" in tables.format_table(runner.add_ratios(rows))


def test_plan_filters_variants_and_overrides_sizes():
    configs = cli.planned_configs(_args("--preset", "cpu-targets", "--levels", "attention", "--P", "1024,2048",
                             "--variants", "naive,mmpg"))
    assert [(c["P"], c["S"], c["G"], c["variants"]) for c in configs] == [
        (1024, 128, 16, ["naive", "mmpg"]), (2048, 128, 16, ["naive", "mmpg"])]
    with pytest.raises(UserError, match="unknown bench level"):
        cli.planned_configs(_args("--levels", "kernel"))


def test_the_docs_preset_plans_the_tables_of_docs_performance(capsys, tmp_path):
    """`--preset docs-cpu` is the one command behind docs/performance.md's headline tables: the attention, model and
    rollout rows at the cpu-targets shapes and the whole GRPO step; its JSON and header carry the date and commit."""
    configs = cli.planned_configs(_args("--preset", "docs-cpu"))
    assert [(c["level"], c["P"], c["S"], c["G"]) for c in configs] == [
        ("attention", 8192, 128, 16), ("model", 4096, 256, 8), ("rollout", 4096, 256, 8), ("step", 2048, 128, 8)]
    assert configs[2]["variants"] == ["hf_generate", "mmpg:copy", "mmpg:cascade"]
    assert cli.planned_configs(_args("--preset", "docs-cpu", "--levels", "step")) == configs[3:]
    out = tmp_path / "plan.json"
    assert cli.run(_args("--preset", "docs-cpu", "--dry-run", "--out", str(out))) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["date"] and "commit" in meta
    assert f"{meta['date']}, commit {meta['commit']}" in capsys.readouterr().out.splitlines()[0]


def test_the_levels_table_finds_each_levels_setup():
    # the worker imports a measured level's module by the name in `levels.LEVELS`, a level that runs alone is a
    # program (`run(args)`); a bad level or variant names the choices
    import importlib

    from mmpg.bench.levels import ALONE, LEVELS, MEASURED, module_for

    for name in MEASURED:
        assert callable(importlib.import_module(module_for({"level": name, "variant": LEVELS[name].baseline})).setup)
    for name in ALONE:
        assert callable(importlib.import_module(LEVELS[name].module).run)
    with pytest.raises(ValueError, match="unknown bench level 'lora'"):
        module_for({"level": "lora", "variant": ""})
    with pytest.raises(ValueError, match="unknown step variant 'repeated'; choose one of naive, mmpg"):
        module_for({"level": "step", "variant": "repeated"})
    with pytest.raises(ValueError, match="unknown bench level 'kernel'"):
        module_for({"level": "kernel", "variant": "naive"})


def test_attention_variants_agree():
    # what the harness times must be the same attention: upstream (with our SDPA function) and mmpg vs the
    # naive forward of each response behind its own copy of the prefix
    from prefix_grouper import PrefixGrouper

    from mmpg.bench.attention import upstream_sdpa
    from mmpg.grouping import GroupLayout
    from mmpg.grouping.backends import get_backend

    torch.manual_seed(0)
    P, S, G, H, Hkv, D = 11, 4, 3, 4, 2, 8
    q, k, v = (torch.randn(1, h, P + G * S, D) for h in (H, Hkv, Hkv))
    scale = D ** -0.5
    ups = PrefixGrouper([[P] + [S] * G]).forward(upstream_sdpa, q, k, v, scaling=scale)  # [1, T, H, D]
    ours = get_backend("sdpa")(q, k, v, GroupLayout([P], [[S] * G], torch.device("cpu")), scale)
    for g in range(G):
        rows = list(range(P)) + list(range(P + g * S, P + (g + 1) * S))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, rows], k[:, :, rows], v[:, :, rows], is_causal=True, scale=scale, enable_gqa=True)
        ref = ref.transpose(1, 2)[0, P:]  # [S, H, D] this response's outputs
        got_rows = slice(P + g * S, P + (g + 1) * S)
        torch.testing.assert_close(ups[0, got_rows], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[0, got_rows], ref, atol=1e-5, rtol=1e-5)


def test_sdpa_kernels_program_lists_both_settings(tmp_path, capsys, monkeypatch):
    """`python -m mmpg.bench.sdpa_kernels` on the CPU: one row per MASKED_EXPAND_KV_HEADS setting with the kernels it
    ran, each equal to the dense rule within float32 roundoff (1e-5), the flag put back as it was, the JSON written."""
    from mmpg.bench import sdpa_kernels
    from mmpg.grouping.backends import sdpa

    monkeypatch.setattr(sdpa, "MASKED_EXPAND_KV_HEADS", "as it was")
    assert sdpa_kernels.main(["--device", "cpu", "--out", str(tmp_path / "k.json")]) == 0
    assert sdpa.MASKED_EXPAND_KV_HEADS == "as it was"
    rows = json.loads((tmp_path / "k.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["expand_kv_heads", "enable_gqa"]
    for r in rows:
        assert r["max_abs_vs_dense"] <= 1e-5 and any("scaled_dot_product" in k for k in r["kernels"]), r
    out = capsys.readouterr().out
    assert "expand_kv_heads" in out and "enable_gqa" in out


def test_upstream_sdpa_handles_padding():
    # padded keys are never attended; a query with no real key gets finite output (it is dropped by the package)
    from mmpg.bench.attention import upstream_sdpa

    q, k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    mask = torch.tensor([[True] * 5, [False, False, True, True, True]])
    out = upstream_sdpa(q, k, v, mask, scaling=0.5)
    assert out.shape == (2, 3, 2, 4) and torch.isfinite(out).all()
    ref = torch.nn.functional.scaled_dot_product_attention(q[1:, :, :, :], k[1:, :, 2:], v[1:, :, 2:], is_causal=True,
                                                           scale=0.5)
    torch.testing.assert_close(out[1], ref[0].transpose(0, 1))
    # a left-padded prefix: its first query sees only a padded key
    q = torch.randn(1, 2, 3, 4)
    out = upstream_sdpa(q, q, q, torch.tensor([[False, True, True]]), scaling=0.5)
    assert torch.isfinite(out).all()


def test_model_variants_agree():
    # repeated, upstream (wired through the transformers registry) and mmpg give the same logprobs
    from mmpg.bench import batch
    from mmpg.bench import model as bench_model
    from mmpg.grouping import grouped_logprobs, repeated_logprobs

    case = {"family": "qwen2", "spec": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                        "intermediate_size": 64}, "P": 20, "S": 5, "G": 3}
    model, ids = bench_model.build_model(case, torch.device("cpu"))
    prompt, completions, mask, info = batch.make_inputs(model, case, ids, "cpu")
    assert info["P"] == 20 and completions.shape == (3, 5)
    with torch.no_grad():
        ref = repeated_logprobs(model, prompt, completions, mask, [3])
        ours = grouped_logprobs(model, prompt, completions, mask, [3])
        model2, _ = bench_model.build_model(case, torch.device("cpu"))
        bench_model._wire_upstream(model2)
        ups = bench_model._upstream_logprobs(model2, prompt, completions)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ups, ref, atol=1e-5, rtol=1e-5)


def test_vl_prompt_has_the_requested_shape():
    from mmpg.bench import batch
    from mmpg.bench import model as bench_model

    case = {"family": "qwen2_5_vl", "spec": {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
                                             "intermediate_size": 64}, "P": 300, "S": 4, "G": 2}
    model, ids = bench_model.build_model(case, torch.device("cpu"))
    prompt, _, _, info = batch.make_inputs(model, case, ids, "cpu")
    t, h, w = prompt["video_grid_thw"][0].tolist()
    assert (prompt["input_ids"] == ids["video"]).sum() == t * h * w // 4 == info["video_tokens"]
    assert prompt["pixel_values_videos"].shape[0] == t * h * w == info["video_patches"]
    assert abs(info["P"] - 300) <= 32


def test_rollout_level_reports_a_missing_engine(tmp_path, monkeypatch):
    # the rollout engine is imported lazily: without it the row says "not available" and the baseline still runs
    import sys

    monkeypatch.setitem(sys.modules, "mmpg.rollout", None)  # makes `import mmpg.rollout` raise ImportError
    config = {"level": "rollout", "P": 24, "S": 3, "G": 2, "family": "qwen2", "dtype": "float32",
              "spec": {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
                       "intermediate_size": 64}, "variants": ["hf_generate", "mmpg"]}
    rows = runner.add_ratios(runner.run_config(config, rounds=1, warmup=1, repeats=1, timeout=60, max_gb=12,
                                               in_process=True, log=lambda m: None))
    assert rows[0]["note"] == "" and rows[0]["time_s"] > 0
    assert rows[1]["note"].startswith("n/a: mmpg.rollout not available")


def test_step_level_in_process_times_every_phase(tmp_path, capsys, step_process):
    # one whole GRPO step per variant through the trainer's own code (GRPOStep.update on a DeepSpeed engine):
    # generate + repeated forward vs shared-prefix rollout + grouped forward, every phase timed
    from mmpg.bench.step import PHASES

    out = tmp_path / "step.json"
    assert cli.run(_args("--preset", "tiny", "--levels", "step", "--in-process", "--out", str(out))) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["level"], r["variant"]) for r in rows] == [("step", "naive"), ("step", "mmpg")]
    naive, ours = rows
    G, S, P = naive["G"], naive["S"], naive["P"]
    for row in rows:
        assert row["note"] == "", row["note"]
        assert set(row["phases"]) == {*PHASES, "total"}
        for name, phase in row["phases"].items():
            assert phase["time_s"] > 0 and phase["speedup"] > 0, (row["variant"], name, phase)
            assert phase["peak_MB"] is None  # in-process: memory is not measured
        assert row["time_s"] == row["phases"]["total"]["time_s"]
        assert row["response_tokens"] == G * S  # no stop token: both decode exactly S tokens per response
        for key in ("rho_rollout", "rho_fwd", "rho_flops", "rho_step"):
            assert row[key] > 1, key
    assert naive["tokens"] == G * (P + S) and ours["tokens"] == P + G * S  # the update's forward
    assert ours["phases"]["update"]["ceiling"] == ours["rho_flops"]
    assert ours["phases"]["total"]["ceiling"] == ours["rho_step"] and ours["phases"]["reward"]["ceiling"] is None
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("level") and "phase" in line)
    cols = header.split()
    lines = [line.split() for line in printed[printed.index(header):].splitlines()[2:] if line.startswith("step")]
    assert [(c[cols.index("variant")], c[cols.index("phase")]) for c in lines] == [
        (v, p) for v in ("naive", "mmpg") for p in (*PHASES, "total")]
    assert all(c[cols.index("peak_MB")] == "n/a" for c in lines)


def test_step_phase_memory_is_relative_to_the_step_start(monkeypatch):
    # each phase resets the high-water mark at its start; its peak is counted from the RSS when the step began
    # (100), and the step's peak is the largest phase peak
    from mmpg.bench import memory
    from mmpg.bench.step import PhaseClock

    hwm = iter([150, 100, 400])  # rollout, reward (no growth: not seen), update
    monkeypatch.setattr(memory, "rss", lambda: 100)
    monkeypatch.setattr(memory, "reset_hwm", lambda: True)
    monkeypatch.setattr(memory, "hwm", lambda: next(hwm))
    clock = PhaseClock(torch.device("cpu"), memory=True)
    with clock.step():
        for name in ("rollout", "reward", "update"):
            with clock(name):
                pass
    assert clock.peaks == {"rollout": 50, "reward": None, "update": 300, "total": 300}
    assert set(clock.seconds) == {"rollout", "reward", "update", "total"} and clock.method == "VmHWM-after-clear_refs"


def test_grpo_step_flops_small_case():
    # the dims of tests/test_flops.py: linear 44 per token, attention 8 per pair, LM head 4 per position;
    # P=4, S=2, G=3 (forward: repeated 1248, grouped 768)
    from mmpg.bench.flops import grpo_step_flops, rho_rollout, rho_step, rollout_flops, step_flops
    from mmpg.models.geometry import Geometry, Vision

    dims = Geometry("hand", hidden=2, layers=1, heads=1, kv_heads=1, intermediate=1, vocab=1)
    # prefill of one copy: 44·4 + 8·(4·4/2) + head 4 = 176 + 64 + 4 = 244 (shared: once; generate: 3 copies)
    # decode: G(S-1) = 3 one-token steps, each attending P + 1 = 5 keys: 44·3 + 8·15 + 4·3 = 132 + 120 + 12 = 264
    assert rollout_flops(dims, 4, 2, 3, shared=True) == 244 + 264
    assert rollout_flops(dims, 4, 2, 3, shared=False) == 3 * 244 + 264
    assert rho_rollout(dims, 4, 2, 3) == pytest.approx(996 / 508)
    # step = rollout + reference forward + forward and backward (3 forwards)
    assert grpo_step_flops(dims, 4, 2, 3, grouped=True) == 508 + 768 + 3 * 768
    assert grpo_step_flops(dims, 4, 2, 3, grouped=False) == 996 + 1248 + 3 * 1248
    assert grpo_step_flops(dims, 4, 2, 3, grouped=True, reference=False) == 508 + 3 * 768
    assert rho_step(dims, 4, 2, 3) == pytest.approx(5988 / 3580)
    # a frozen vision tower (304 per video, see tests/test_flops.py) runs forward only: 1× instead of 3×
    v = Vision(hidden=2, depth=1, intermediate=1, out_hidden=2, merge=1)
    vdims = Geometry("hand", hidden=2, layers=1, heads=1, kv_heads=1, intermediate=1, vocab=1, vision=v)
    video = {"video_patches": 4, "frame_patches": 2}
    assert step_flops(vdims, 4, 2, 3, False, train_vision=False, **video) == 3 * 1248 + 3 * 304
    assert step_flops(vdims, 4, 2, 3, True, train_vision=False, **video) == 3 * 768 + 304
    # the rollout encodes the video once in both variants
    assert rollout_flops(vdims, 4, 2, 3, False, **video) - rollout_flops(dims, 4, 2, 3, False) == 304


def test_queries_per_video_adds_the_tree_to_step_configs_only():
    configs = cli.planned_configs(_args("--preset", "tiny", "--levels", "model,step", "--queries-per-video", "1,3",
                             "--tail", "5"))
    steps = [c for c in configs if c["level"] == "step"]
    assert [(c.get("Q"), c["variants"]) for c in steps] == [(None, ["naive", "mmpg"]),
                                                            (3, ["naive", "mmpg", "tree"])]
    assert steps[1]["t"] == 5
    assert all("Q" not in c for c in configs if c["level"] != "step")


def test_query_batch_shares_exactly_the_video_part():
    # Q prompts of one video: identical pixels and first P tokens, distinct tails; grouping's own share finder
    # (mmpg.grouping.shares.find_shares) must see one share of exactly P tokens
    from mmpg.bench.batch import make_query_batch
    from mmpg.bench.model import build_model
    from mmpg.grouping.adapters import prefix_positions
    from mmpg.grouping.inputs import placeholder_token_ids, split_visuals_per_prompt
    from mmpg.grouping.shares import find_shares

    case = {"level": "step", "P": 48, "S": 6, "G": 3, "Q": 3, "t": 5, "family": "qwen2_5_vl",
            "spec": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
            "dtype": "float32", "variant": "tree"}
    model, ids = build_model(case, torch.device("cpu"))
    prompt, info = make_query_batch(model, case, ids, torch.device("cpu"))
    assert prompt["input_ids"].shape == (3, info["P"] + 5)
    assert prompt["video_grid_thw"].shape[0] == 3
    visuals = split_visuals_per_prompt(model, prompt)
    shares = find_shares(prefix_positions(model, prompt, visuals), visuals, placeholder_token_ids(model), [3, 3, 3])
    assert [(s.prompts, s.length) for s in shares] == [((0, 1, 2), info["P"])]


def test_step_level_with_queries_per_video_times_the_tree(tmp_path, capsys, step_process):
    # Q = 3 queries of one video: naive, per-query grouping (mmpg) and the tree, every phase timed; the tree's
    # rollout prefills the video once and its update packs the tokens `layout_tokens` says
    from mmpg.bench.flops import layout_tokens

    out = tmp_path / "tree.json"
    assert cli.run(_args("--preset", "tiny", "--levels", "step", "--queries-per-video", "3", "--tail", "5",
                         "--in-process", "--out", str(out))) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["naive", "mmpg", "tree"]
    naive, per, tree = rows
    P, S, G = tree["P"], tree["S"], tree["G"]
    for row, layout in zip(rows, ("naive", "per_query", "tree")):
        assert row["note"] == "", row["note"]
        assert (row["Q"], row["t"]) == (3, 5)
        assert row["tokens"] == layout_tokens(layout, P, 5, S, G, 3)
        assert row["response_tokens"] == 3 * G * S
    assert per["rollout_stats"]["prefixes"] == 3 and per["shared_prompts"] == 0
    assert tree["rollout_stats"] == {"prompts": 3, "prefixes": 1, "prefix_tokens": P + 3 * 5, "shared_prompts": 2}
    assert tree["shared_prompts"] == 2  # the update packed two prompts behind the first one's video
    assert tree["phases"]["update"]["ceiling"] == tree["rho_flops_tree"] > per["rho_flops"]
    # the video encoded once per forward as a tree (rollout, reference, update: 3), once per query per forward
    # query-wise (9), and 3 x G times in the naive update and reference (+ once per query in generate's prefill)
    assert (tree["vision_calls"], per["vision_calls"]) == (3, 9) and naive["vision_calls"] > per["vision_calls"]
    assert 0 < tree["kv_bytes"] < per["kv_bytes"] and naive["kv_bytes"] is None
    printed = capsys.readouterr().out
    assert "tree vs per-query grouping" in printed and "true three-level tree" in printed


def test_eval_level_answers_a_videos_queries_once_each(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert cli.run(_args("--preset", "tiny", "--levels", "eval", "--in-process", "--out", str(out))) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["hf_generate", "mmpg", "tree"]
    per, tree = rows[1], rows[2]
    assert (per["prefixes"], tree["prefixes"]) == (3, 1)
    assert tree["prefix_tokens"] == tree["P"] + 3 * tree["t"] and per["prefix_tokens"] == 3 * (per["P"] + per["t"])
    assert tree["rho_eval_tree"] > 1 and per["pct_ceiling"] is None  # per query is the baseline
    # float32, no padding: the engine's greedy answers are generate's, token for token, shared video or not
    assert [r["same_answers"] for r in rows] == [3, 3, 3]
    assert "eval: Q queries of one video" in capsys.readouterr().out


def test_eval_level_batches_several_videos(tmp_path):
    # B = 2 videos of 3 queries each in one batch: each video's shared part prefilled once, never one across videos
    out = tmp_path / "eval_b2.json"
    assert cli.run(_args("--preset", "tiny", "--levels", "eval", "--videos-per-batch", "2", "--in-process",
                         "--variants", "hf_generate,tree", "--out", str(out))) == 0
    generate, tree = json.loads(out.read_text())["rows"]
    assert (generate["B"], tree["B"]) == (2, 2)
    assert tree["prefixes"] == 2 and tree["prefix_tokens"] == 2 * (tree["P"] + 3 * tree["t"])
    assert tree["same_answers"] == 6 and generate["same_answers"] == 6


def test_no_preset_prints_the_plan_and_runs_nothing(tmp_path, capsys, monkeypatch):
    """`mmpg bench` alone: what cpu-targets would run and how to start it; nothing measured or written."""
    monkeypatch.chdir(tmp_path)
    from mmpg.bench import runner

    monkeypatch.setattr(runner, "run_config", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    assert cli.run(_args()) == 0
    out = capsys.readouterr().out
    assert "nothing measured" in out and "--preset cpu-targets" in out
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("level, words", [("lora", "full vs LoRA (r 16)"), ("async", "2 rounds per arm of 12")])
def test_dry_run_of_a_separate_level_measures_nothing(level, words, monkeypatch, capsys):
    import importlib

    from mmpg.bench.levels import LEVELS

    module = importlib.import_module(LEVELS[level].module)
    monkeypatch.setattr(module, "run", lambda args: pytest.fail(f"--dry-run ran the {level} level"))
    assert cli.run(_args("--levels", level, "--dry-run")) == 0
    out = capsys.readouterr().out
    assert words in out and "measures nothing" in out


def test_vllm_level_sizes_and_table():
    """`--levels vllm`: sizes read as prompts x G x tokens (a bad one names itself); the table puts each way beside
    the one-request ceiling."""
    from mmpg.bench.serving import format_table, parse_sizes

    assert parse_sizes("2x4x48, 4X8X24") == [(2, 4, 48), (4, 8, 24)]
    with pytest.raises(ValueError, match="'2x4' is not BxGxS"):
        parse_sizes("2x4x48,2x4")
    row = {"B": 2, "G": 4, "S": 48, "same": True,
           "median_s": {"one request": 0.2, "at once": 0.22, "one after another": 0.3}}
    assert format_table([row]).splitlines()[-1] == "| 2 x 4 x 48 | 0.200 | 0.220 | 0.300 | 1.10x | 1.50x | 1.00x | yes |"
