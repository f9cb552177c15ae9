"""`mmpg eval` under the papers' protocols on their benchmark files, end to end on the CPU (tiny Qwen2.5-VL, short
synthetic mp4s): TVGBench's degenerate records all evaluated under `tvgbench` (the real file: 800 of 800, not 788),
and TimeLens-Bench's format and protocol (`timelens`) on the fixture in tests/fixtures/timelens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batches import write_mp4
from mmpg.runs.evals import EvalReader

pytestmark = pytest.mark.slow

FAST = ["fps=1", "max_frames=4", "min_pixels=3136", "max_pixels=3136", "total_pixels=12544", "max_new_tokens=8",
        "num_workers=0", "batch_size=4", "self_check=off"]
TIMELENS = Path(__file__).parent / "fixtures" / "timelens"


def _videos(folder: Path, seconds: dict[str, int]) -> Path:
    """One 1-fps 32x32 noise mp4 per name, `seconds[name]` frames long."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in seconds.items():
        write_mp4(folder / f"{name}.mp4", (rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(n)), 1)
    return folder


def _eval(args, capsys) -> str:
    from mmpg.cli import main

    code = main(["eval"] + [str(a) for a in args])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return out.out


def test_tvgbench_protocol_evaluates_every_record(grpo_data, tmp_path, capsys):
    """The 5-record TVGBench copy (a zero-length moment and one ending 4.85 s past its clip among them): 5 loaded,
    5 evaluated and scored, each against the file's span; the Coverage section names the 2 kept as written."""
    from test_benchmark_files import tvgbench_list

    ann = tmp_path / "tvgbench.json"
    ann.write_text(json.dumps(tvgbench_list()))
    videos = _videos(tmp_path / "videos", {"KWZSA": 30, "aHDGMOQgHUE": 99, "EXYY8": 19, "s30-d52": 134, "s31-d53": 28})
    prompt = tmp_path / "prompt.txt"
    prompt.write_text('When does "{query}" happen? Answer "START to END" in seconds.')
    out = tmp_path / "out"
    _eval(["--checkpoint", grpo_data["model"], "--annotations", ann, "--videos", videos, "--protocol", "tvgbench",
           "--out", out, f"prompt_file={prompt}"] + FAST, capsys)
    reader = EvalReader(out)
    info, metrics, records = reader.info(), reader.metrics(), reader.predictions()
    assert (info["benchmark_size"], info["annotations_left_out_count"], metrics["count"], metrics["failed"]) == \
        (5, 0, 5, 0)
    assert [r.gt_span for r in records][3:] == [[85.83, 85.83], [7.37, 32.75]]
    report = (out / "report.md").read_text()
    assert "kept as written (the paper's loader keeps every record): **2**" in report
    assert "1 x zero-length" in report and "1 x ending more than max(2 s, 10 %) past the duration" in report


def test_timelens_protocol_runs_on_the_fixture(grpo_data, tmp_path, capsys):
    """TimeLens-Bench's Charades file (4 queries, 3 videos) and a fifth record repeating KWZSA's (its query written
    with a leading period, the same after TimeLens's parse_query) under `--protocol timelens`: its settings in
    eval.json, R1 with >= first, every query scored against the file's span (30.5 past the 30.12 s video kept
    unclamped), the repeat counted once as TimeLens counts it, the every-record figures beside."""
    videos = _videos(tmp_path / "videos", {"3MSZA": 31, "AO8RW": 13, "KWZSA": 30})
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Find the event '{query}'. Answer 'The event happens in <start time> - <end time> seconds'.")
    bench = json.loads((TIMELENS / "charades-timelens.json").read_text())
    bench["KWZSA"]["spans"].append([13.4, 30.5])
    bench["KWZSA"]["queries"].append(".A person sits down at the table")
    ann = tmp_path / "charades-timelens.json"
    ann.write_text(json.dumps(bench))
    out = tmp_path / "out"
    printed = _eval(["--checkpoint", grpo_data["model"], "--annotations", ann, "--videos", videos, "--protocol",
                     "timelens", "--out", out, f"prompt_file={prompt}"] + FAST, capsys)
    assert "tIoU >= m (VideoChat-R1)" in printed
    reader = EvalReader(out)
    info, metrics, records = reader.info(), reader.metrics(), reader.predictions()
    s = info["settings"]
    assert (info["protocol"], s["format"], s["scoring"], s["threshold_rule"], s["parser"]) == \
        ("timelens", "timelens", "timelens", "ge", "mmpg.eval.metrics.timelens_span")
    assert (s["query_clean"], s["duplicates"], s["min_tokens"], s["max_tokens"]) == ("timelens", "once", None, None)
    assert (s["video"]["min_pixels"], s["video"]["total_pixels"]) == (3136, 12544)  # FAST's pixels replace tokens
    assert (metrics["count"], metrics["total"], metrics["failed"], metrics["duplicate_records"]) == (4, 4, 0, 1)
    assert metrics["every_record/count"] == 5
    assert [r.sample_id for r in sorted(records, key=lambda r: r.index)] == ["3MSZA#0", "3MSZA#1", "AO8RW#0",
                                                                             "KWZSA#0", "KWZSA#1"]
    assert sorted(records, key=lambda r: r.index)[3].gt_span == [13.4, 30.5]
    report = (out / "report.md").read_text()
    assert report.index("tIoU >= m (VideoChat-R1) |") < report.index("tIoU > m (Time-R1) |")
    assert "scored against the file's own span (scoring timelens)" in report
    assert "repeating an earlier one's (video, query, span): **1**; the metrics above count each such key once" \
        in report and "counting every record instead: 5 scored" in report
