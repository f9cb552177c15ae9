"""`mmpg bench --levels step --sp N` (`mmpg.bench.sp`): the step level with its packed row spread over N gloo
processes beside one process. Harness checks only (benchmarks are programs): the plan, the merge of the ranks'
results, the ceilings worked out by hand, and one tiny end-to-end run of 2 ranks whose JSON and table hold each
rank's peak for sp 1 and sp 2. No timing is asserted."""

from __future__ import annotations

import argparse
import json

import pytest

from mmpg.bench import cli
from mmpg.bench.sp import ceilings, merge, sp_table
from mmpg.errors import UserError


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_adds_an_sp_copy_of_each_step_config_without_naive():
    configs = cli.planned_configs(_args("--preset", "tiny", "--levels", "step", "--sp", "2"))
    assert [(c.get("sp", 1), c["variants"]) for c in configs] == [(1, ["naive", "mmpg"]), (2, ["mmpg"])]
    with pytest.raises(UserError, match="--sp 2: .* step level alone"):
        cli.planned_configs(_args("--preset", "tiny", "--levels", "model,step", "--sp", "2"))
    assert [c["level"] for c in cli.planned_configs(_args("--preset", "sp-cpu"))] == ["step"] * 4  # step implied


def _rank(times, peaks, row_tokens):
    return {"times": [t["total"] for t in times], "cold_s": 1.0, "phase_times": times, "phase_peak_bytes": peaks,
            "peak_bytes": peaks["total"], "mem_method": "m", "error": None, "info": {"row_tokens": row_tokens}}


def test_merge_takes_the_slowest_rank_and_the_largest_peak_and_keeps_each():
    a = _rank([{"update": 2.0, "total": 3.0}], {"update": 100, "total": 100}, 10)
    b = _rank([{"update": 2.5, "total": 2.9}], {"update": 120, "total": 120}, 9)
    out = merge([a, b])
    assert out["times"] == [3.0] and out["phase_times"] == [{"update": 2.5, "total": 3.0}]
    assert out["peak_bytes"] == 120 and out["phase_peak_bytes"] == {"update": 120, "total": 120}
    assert out["rank_phase_peak_bytes"]["update"] == [100, 120] and out["info"]["row_tokens"] == [10, 9]


def test_ceilings_by_hand():
    mb = 2**20
    # sp 1: 2 threads; update peak 1012 MB of which F = 12 B x 1 Mi parameters = 12 MB is whole on every rank
    one = {"threads": 2, "trainable_params": mb, "Q": 1, "config": {},
           "phases": {"rollout": {"peak_MB": 300, "time_s": 4.0}, "reward": {"peak_MB": 300, "time_s": 0.5},
                      "logprob": {"peak_MB": 400, "time_s": 2.0}, "update": {"peak_MB": 1012, "time_s": 6.0},
                      "total": {"peak_MB": 1012, "time_s": 13.0}}}
    row = {"threads": 1, "Q": 1, "config": {"sp": 2}}
    c = ceilings(one, row)
    assert c["update"]["mem_MB"] == pytest.approx(12 + 1000 / 2)  # 512
    assert c["logprob"]["mem_MB"] == pytest.approx(200) and c["rollout"]["mem_MB"] == 300  # 1 prompt: unsplit
    assert c["total"]["mem_MB"] == pytest.approx(512)
    # time: c_1 / c_2 = 2; forwards halved (6 -> 6, 2 -> 2), rollout and reward whole (4 -> 8, 0.5 -> 1),
    # the 0.5 s outside the phases doubled: 6 + 2 + 8 + 1 + 1 = 18
    assert c["update"]["time_s"] == pytest.approx(6.0) and c["rollout"]["time_s"] == pytest.approx(8.0)
    assert c["total"]["time_s"] == pytest.approx(18.0)


def test_tiny_sp2_step_end_to_end_reports_each_ranks_peak(tmp_path, capsys):
    # 1 process (sp 1) and 2 gloo processes (sp 2) of the tiny step, mmpg only (naive adds nothing here)
    out = tmp_path / "sp.json"
    assert cli.run(_args("--preset", "tiny", "--levels", "step", "--sp", "2", "--variants", "mmpg",
                         "--out", str(out))) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["config"].get("sp", 1)) for r in rows] == [("mmpg", 1), ("mmpg", 2)]
    one, two = rows
    for row, sp in ((one, 1), (two, 2)):
        assert row["note"] == "", row["note"]
        for name in ("update", "total"):
            ranks = row["rank_phase_peak_MB"][name]
            assert len(ranks) == sp and all(m is not None and m > 0 for m in ranks), (sp, name, ranks)
            assert row["phases"][name]["peak_MB"] == max(ranks)
        assert len(row["row_tokens"]) == sp
    # each rank held half the packed row (rounded up: the row is padded to a multiple of sp)
    assert two["row_tokens"] == [-(-one["row_tokens"][0] // 2)] * 2
    printed = capsys.readouterr().out
    table = printed[printed.index("sequence parallelism:"):].splitlines()
    header = next(line for line in table if line.lstrip().startswith("P"))
    assert "upd_MB" in header and "ranks' upd_MB" in header
    lines = [line.split() for line in table if line.lstrip().startswith(str(one["P"]))]
    assert [line[1:3] for line in lines] == [["mmpg", "1"], ["mmpg", "2"]]
    assert len(lines[1][-1].split("/")) == 2  # both ranks' update peaks
    assert sp_table(rows) in printed
