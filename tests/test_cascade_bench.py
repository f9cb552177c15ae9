"""`mmpg bench --levels rollout`: the three variants (generate, copy, cascade) with their phases and K/V memory, run
in-process on a tiny text model (timings are not asserted: benchmarks are programs, not tests)."""

from __future__ import annotations

import argparse

import pytest

from mmpg.bench import cli, runner, tables

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}


def test_rollout_level_reports_phases_and_kv_memory():
    config = {"level": "rollout", "P": 40, "S": 4, "G": 3, "family": "qwen2", "dtype": "float32", "spec": TINY,
              "variants": ["hf_generate", "mmpg:copy", "mmpg:cascade"]}
    rows = runner.add_ratios(runner.run_config(config, rounds=1, warmup=1, repeats=1, timeout=60, max_gb=12,
                                               in_process=True, log=lambda m: None))
    by = {r["variant"]: r for r in rows}
    for row in rows:
        assert row["note"] == "" and row["time_s"] > 0 and row["prefill_s"] > 0 and row["decode_s"] > 0
    P, S, G = by["mmpg:copy"]["P"], 4, 3
    # after the last step the copy cache holds G rows of P + S - 1 tokens, the cascade one P + G·S (preallocated)
    assert by["mmpg:cascade"]["kv_ratio"] == pytest.approx(G * (P + S - 1) / (P + G * S))
    assert by["mmpg:copy"]["kv_ratio"] == 1.0 and by["hf_generate"]["kv_MB"] == by["mmpg:copy"]["kv_MB"]
    table = tables.rollout_table(rows)
    assert "mmpg:cascade" in table and "prefill_s" in table and "kv_ratio" in table


def test_rollout_presets_plan_three_variants():
    def args(preset, levels=None):
        return argparse.Namespace(preset=preset, levels=levels, family="qwen2", P=None, S=None, G=None,
                                  variants=None)

    (cpu,) = cli.planned_configs(args("rollout-cpu"))
    assert (cpu["level"], cpu["P"], cpu["S"], cpu["G"]) == ("rollout", 4096, 256, 8)
    assert cpu["variants"] == ["hf_generate", "mmpg:copy", "mmpg:cascade"] and cpu["spec"]["hidden_size"] == 256
    (gpu,) = cli.planned_configs(args("rollout-gpu"))
    assert gpu["dtype"] == "bfloat16" and gpu["G"] == 16
    derived = [c for c in cli.planned_configs(args("cpu-targets", ["rollout"]))]
    assert [c["variants"] for c in derived] == [["hf_generate", "mmpg:copy", "mmpg:cascade"]]
