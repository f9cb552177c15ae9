"""`mmpg bench --levels data` (mmpg.bench.data) at a tiny size: the generated video (3 s of 1280x720 at 30 fps here,
20 minutes by default), the three tables' rows and their JSON, the parts equal to the whole decode, the cache read
back equal, the process's cores and torch threads given back; the table's arithmetic on fabricated rows. No timing
is asserted (benchmarks are programs, not tests)."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from mmpg.bench import cli
from mmpg.bench import data as bench_data
from mmpg.data.video import probe_video


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_dry_run_says_what_a_run_measures(monkeypatch, capsys):
    monkeypatch.setattr(bench_data, "run", lambda args: pytest.fail("--dry-run measured"))
    assert cli.run(_args("--levels", "data", "--dry-run", "--data-minutes", "2")) == 0
    out = capsys.readouterr().out
    assert "generated 2-minute 1280x720 30 fps video" in out and "sp 1 vs 2" in out and "measures nothing" in out


def test_the_settings_are_the_configs():
    got = bench_data.specs()
    assert list(got) == ["7B config", "long config", "Time-R1 recipe"]
    assert (got["long config"].fps, got["long config"].max_frames, got["long config"].total_pixels) == \
        (1.0, 768, 65536 * 28 * 28)
    assert (got["Time-R1 recipe"].fps, got["Time-R1 recipe"].total_pixels) == (2.0, 3584 * 28 * 28)
    assert all(s.image_patch_size == 14 for s in got.values())


def test_a_short_run_fills_the_three_tables(tmp_path, capsys):
    path, render_s = bench_data.generated_video(0.05, folder=str(tmp_path))
    assert render_s is not None and probe_video(path) == (90, 30.0)  # 3 s at 30 fps
    assert bench_data.generated_video(0.05, folder=str(tmp_path)) == (path, None)  # rendered once, then reused
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    out = tmp_path / "bench.json"
    argv = ("--levels", "data", "--data-video", path, "--data-core", str(min(cores)), "--out", str(out))
    assert cli.run(_args(*argv)) == 0
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)
    printed = capsys.readouterr().out
    assert "| settings | frames |" in printed and "| sp | rank |" in printed and "| frame cache |" in printed
    rows = json.loads(out.read_text())["rows"]
    decode = [(r["settings"], r["frames"], r["height"], r["width"]) for r in rows if r["table"] == "decode"]
    # 3 s at 2 fps: 6 frames; at 1 fps 3, raised to min_frames 4. 1280x720 under 256 tokens a frame: 336x588; Time-R1's
    # budget (3,584 x 784 x 2 / 6 = 936,619 pixels a frame) is above its 768 tokens (602,112), which bind: 560x1008
    assert decode == [("7B config", 6, 336, 588), ("long config", 4, 336, 588), ("Time-R1 recipe", 6, 560, 1008)]
    sp = [(r["sp"], r["rank"], r["groups"], r["frames"], r["equal"], r["ceiling"]) for r in rows if r["table"] == "sp"]
    assert sp == [(1, 0, [0, 2], 4, None, 1.0), (2, 0, [0, 1], 2, True, 0.5), (2, 1, [1, 2], 2, True, 0.5)]
    cold, warm = (r for r in rows if r["table"] == "cache")
    assert (cold["hit"], warm["hit"], warm["equal"]) == (False, True, True)
    assert warm["entry_bytes"] > 4 * 3 * 336 * 588  # the uint8 frames and a header
    assert all(r["cpu_s"] > 0 for r in rows if r["table"] != "cache" or r["state"] == "cold")


def test_tables_put_each_rank_beside_sp_1_and_its_ceiling():
    rows = [{"table": "sp", "sp": 1, "rank": 0, "groups": [0, 384], "frames": 768, "seconds": 12.0, "cpu_s": 10.0,
             "ratio": 1.0, "ceiling": 1.0, "equal": None},
            {"table": "sp", "sp": 2, "rank": 0, "groups": [0, 192], "frames": 384, "seconds": 7.0, "cpu_s": 5.5,
             "ratio": 0.55, "ceiling": 0.5, "equal": True},
            {"table": "sp", "sp": 2, "rank": 1, "groups": [192, 384], "frames": 384, "seconds": 6.0, "cpu_s": 4.8,
             "ratio": 0.48, "ceiling": 0.5, "equal": False},
            {"table": "cache", "state": "cold", "seconds": 11.0, "cpu_s": 10.4, "hit": False, "entry_bytes": 276e6},
            {"table": "cache", "state": "warm", "seconds": 0.6, "cpu_s": 0.52, "hit": True, "entry_bytes": 276e6,
             "equal": True}]
    lines = bench_data.format_tables(rows).splitlines()
    assert "| 2 | 0 | 0-192 | 384 | 7.00 | 5.50 | 0.55 | 0.50 | yes |" in lines
    assert "| 2 | 1 | 192-384 | 384 | 6.00 | 4.80 | 0.48 | 0.50 | NO |" in lines
    assert "| 2 | slowest | | | | 5.50 | **0.55** | 0.50 | |" in lines  # the slowest rank sets the group's pace
    assert "| warm | 0.60 | 0.52 | 20.0x | 276 | yes | yes |" in lines  # 10.4 / 0.52 CPU s
