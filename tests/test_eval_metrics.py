"""Grounding metrics on hand-made answers (worked out by hand in the comments), settings and protocols, reports,
plots, and `mmpg eval` refusing bad input with one line and exit status 2. Fast: no model is run."""

from __future__ import annotations

import json
import math

import pytest

from mmpg.errors import UserError
from mmpg.eval.metrics import benchmark_metrics, grounding_metrics, recall, score_answer
from mmpg.eval.protocols import PROTOCOLS, eval_template
from mmpg.eval.settings import FIELDS, load_settings


def _answer(span: str) -> str:
    return f"<think>looking</think><answer>{span}</answer>"


@pytest.mark.parametrize("m, span", [(0.3, "0 to 3"), (0.5, "0 to 5"), (0.7, "0 to 7")])
def test_a_tie_exactly_at_the_threshold_counts_only_with_ge(m, span):
    # truth 0..10 s, prediction 0..10m s: tIoU = 10m / 10 = m exactly (a correctly rounded quotient of integers)
    scored = score_answer(_answer(span), (0.0, 10.0), 10.0)
    assert scored.iou == m
    metrics = benchmark_metrics([scored.iou], [False], [False])
    assert metrics[f"r1@{m}"] == 0.0  # Time-R1: tIoU > m
    assert metrics[f"r1@{m}_ge"] == 1.0  # VideoChat-R1: tIoU >= m
    assert grounding_metrics([scored.span], [(0.0, 10.0)])[f"r1@{m}_ge"] == 1.0


def test_parse_semantics_unparseable_reversed_and_outside_the_video():
    assert score_answer("around five seconds", (3, 7), 10).span is None  # no <answer> tags
    assert score_answer(_answer("soon"), (3, 7), 10).span is None  # no span inside them
    reversed_ = score_answer(_answer("7 to 3"), (3, 7), 10)
    assert reversed_.span is None and reversed_.iou == 0.0 and "after end" in reversed_.reason
    assert score_answer(_answer("7 to 3"), (3, 7), 10, swap_reversed=True) == (((3.0, 7.0)), 1.0, None)
    outside = score_answer(_answer("20 to 30"), (3, 7), 10)  # wholly after the 10 s video
    assert outside.span is None and "outside the video" in outside.reason
    # partly outside: clamped to [0, duration] = 5..10, which is the truth exactly
    assert score_answer(_answer("5 to 15"), (5, 10), 10) == ((5.0, 10.0), 1.0, None)


def _hand_made():
    """Seven samples: tie at 0.5, 5/7, three unparseable (text, reversed, outside), a perfect clamped one, a failed
    video. tIoUs: 0.5, 5/7 = 0.714, 0, 0, 0, 1, 0 (failed)."""
    answers = [(_answer("0 to 5"), (0, 10)),  # tIoU 5/10 = 0.5
               (_answer("3 to 9"), (2, 8)),  # inter 3..8 = 5, union 2..9 = 7: 5/7
               ("no idea", (2, 4)), (_answer("7 to 3"), (3, 7)), (_answer("20 to 30"), (3, 7)),
               (_answer("5 to 15"), (5, 10))]  # clamped to 5..10: 1
    scored = [score_answer(text, truth, 10.0) for text, truth in answers]
    ious = [s.iou for s in scored] + [0.0]
    unparseable = [s.span is None for s in scored] + [False]
    return ious, unparseable, [False] * 6 + [True]


def test_benchmark_metrics_fail_mode_counts_failed_videos_as_zero():
    ious, unparseable, failed = _hand_made()
    assert ious[:6] == [0.5, 5 / 7, 0.0, 0.0, 0.0, 1.0]
    m = benchmark_metrics(ious, unparseable, failed, "fail")
    # 7 in the denominators: > 0.3: {0.5, 0.714, 1} = 3; > 0.5: {0.714, 1} = 2; >= 0.5 adds the tie: 3;
    # > 0.7 and >= 0.7: {0.714, 1} = 2; mIoU = (0.5 + 5/7 + 1) / 7
    assert (m["count"], m["total"], m["failed"], m["unparseable_count"]) == (7, 7, 1, 3)
    assert m["r1@0.3"] == m["r1@0.3_ge"] == pytest.approx(3 / 7)
    assert m["r1@0.5"] == pytest.approx(2 / 7) and m["r1@0.5_ge"] == pytest.approx(3 / 7)
    assert m["r1@0.7"] == m["r1@0.7_ge"] == pytest.approx(2 / 7)
    assert m["miou"] == pytest.approx((0.5 + 5 / 7 + 1) / 7)
    assert m["unparseable"] == pytest.approx(3 / 7) and m["failed_share"] == pytest.approx(1 / 7)


def test_benchmark_metrics_skip_mode_leaves_failed_videos_out():
    ious, unparseable, failed = _hand_made()
    m = benchmark_metrics(ious, unparseable, failed, "skip")
    # 6 in the denominators, the failed one counted apart
    assert (m["count"], m["total"], m["failed"], m["unparseable_count"]) == (6, 7, 1, 3)
    assert m["r1@0.5"] == pytest.approx(2 / 6) and m["r1@0.5_ge"] == pytest.approx(3 / 6)
    assert m["miou"] == pytest.approx((0.5 + 5 / 7 + 1) / 6) and m["unparseable"] == pytest.approx(3 / 6)


def test_empty_prediction_lists():
    assert grounding_metrics([], []) == {"count": 0.0}
    m = benchmark_metrics([], [], [])
    assert m["count"] == 0 and m["total"] == 0 and math.isnan(m["miou"]) and math.isnan(m["r1@0.5"])
    assert math.isnan(recall([], 0.5))
    everything_failed = benchmark_metrics([0.0], [False], [True], "skip")
    assert everything_failed["count"] == 0 and everything_failed["failed"] == 1
    assert math.isnan(everything_failed["miou"])
    with pytest.raises(ValueError, match="lengths differ"):
        benchmark_metrics([0.1], [], [])


def test_fixed_batches_do_not_depend_on_what_is_done():
    from mmpg.eval.batches import fixed_batches

    assert fixed_batches(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert fixed_batches([1, 2, 3, 7], 3) == [[1, 2], [3], [7]]  # a half-done batch: its missing samples
    assert fixed_batches([], 3) == []


def test_settings_merge_protocol_then_overrides(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text('Where in the video is "{query}"? <answer>START to END</answer>')
    s = load_settings("time_r1", ["max_new_tokens=64", "fps=1", f"prompt_file={prompt}"])
    assert (s.template, s.scoring, s.total_tokens, s.threshold_rule, s.max_new_tokens, s.fps) == \
        ("file", "last_span", 3584, "gt", 64, 1.0)
    assert s.video_values_for("qwen2_5_vl")["total_pixels"] == 3584 * 28 * 28  # its code's 3584*28*28
    assert load_settings("videochat_r1", [f"prompt_file={prompt}"]).threshold_rule == "ge"
    assert load_settings().template == "time_r1" and load_settings().bad_videos == "fail"
    assert load_settings().share_videos and not load_settings("default", ["share_videos=false"]).share_videos
    assert load_settings("default", ["self_check=off"]).self_check == "off"  # not YAML's False
    with pytest.raises(UserError, match=r"unknown eval setting 'fsp'; did you mean fps\?"):
        load_settings("default", ["fsp=2"])
    with pytest.raises(UserError, match="'bad_videos' is 'maybe'; choose one of fail, skip"):
        load_settings("default", ["bad_videos=maybe"])
    with pytest.raises(UserError, match="unknown protocol"):
        load_settings("nope")
    assert load_settings().zoom_list_tools and not load_settings(
        "default", ["template=zoom", "zoom_list_tools=false"]).zoom_list_tools
    with pytest.raises(UserError, match="'zoom_list_tools' is false but template is 'time_r1'"):
        load_settings("default", ["zoom_list_tools=false"])


def test_every_protocol_says_where_its_numbers_come_from(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text('Where in the video is "{query}"? <answer>START to END</answer>')
    assert {"default", "time_r1", "videochat_r1", "tvgbench"} <= set(PROTOCOLS)
    for p in PROTOCOLS.values():
        assert p.summary and "Source:" in p.source
        assert set(p.settings) <= set(FIELDS)
        s = load_settings(p.name, [f"prompt_file={prompt}"] if p.prompt_where else [])
        eval_template(s.template, s.prompt_file, s.query_clean)  # the template exists
        assert (s.scoring == "mmpg") == (p.name == "default")
    for name in ("time_r1", "videochat_r1"):
        source = PROTOCOLS[name].source
        assert "assumed" in source or "Assumed" in source or "constants" in source
        assert "Not reproduced" in source
        assert {"template", "fps", "max_frames", "total_tokens", "max_new_tokens", "threshold_rule"} <= \
            set(PROTOCOLS[name].settings)


def test_report_shows_the_protocol_convention_first_and_what_happened_to_bad_videos():
    from mmpg.eval.markdown import eval_report, over_steps_report
    from mmpg.runs.evals import PredictionRecord

    ious, unparseable, failed = _hand_made()
    records = [PredictionRecord(index=0, sample_id="a#0", video="a.mp4", duration=10.0, query="q", gt_span=[0, 10],
                                pred_span=None, text="no idea", iou=0.0),
               PredictionRecord(index=1, sample_id="b#0", video="b.mp4", duration=math.nan, query="q",
                                gt_span=[0, 1], pred_span=None, text="", iou=0.0, error="b.mp4: video file not found")]
    for rule, mode in (("ge", "skip"), ("gt", "fail")):
        info = {"benchmark": "bench", "checkpoint": "ckpt", "protocol": "p", "settings": {
            "threshold_rule": rule, "bad_videos": mode, "fps": 2.0, "template_text": {"user": "U", "system": None}}}
        text = eval_report(info, benchmark_metrics(ious, unparseable, failed, mode), records)
        rows = [line for line in text.splitlines() if line.startswith("| tIoU")]
        assert rows[0].startswith("| tIoU >= m (VideoChat-R1)" if rule == "ge" else "| tIoU > m (Time-R1)")
        assert len(rows) == 2 and "| fps | 2.0 |" in text and "b.mp4: video file not found" in text
        assert ("left out of the metrics (bad_videos=skip)" if mode == "skip" else "scored as failures") in text
        assert "1 x no <answer>...</answer> in the response" in text
    table = over_steps_report("bench", "run", [(1, {"r1@0.5": 0.25, "miou": 0.1}), (2, {"r1@0.5": 0.5})])
    assert "| 1 | n/a | 25.00 | n/a | 10.00 |" in table and "| 2 |" in table


def test_plots_are_png_files(tmp_path):
    from mmpg.eval import plots

    paths = [plots.recall_plot(tmp_path / "r.png", [0.1, 0.5, 0.9]),
             plots.iou_histogram(tmp_path / "h.png", [0.1, 0.5, 0.9], 1),
             plots.start_end_plot(tmp_path / "s.png", [((1, 2), (1.5, 2.5))]),
             plots.start_end_plot(tmp_path / "e.png", []),
             plots.over_steps_plot(tmp_path / "o.png", [(1, {"r1@0.3": 0.2, "miou": 0.1}), (2, {"r1@0.3": 0.4})])]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["e.png", "h.png", "o.png", "r.png", "s.png"]  # no temps


def test_a_rerun_with_other_settings_is_refused(tmp_path):
    from mmpg.runs.evals import EvalWriter, check_settings

    info = {"checkpoint": "c", "annotations": "a", "videos": "v", "protocol": "default", "settings": {"fps": 2.0}}
    EvalWriter(tmp_path).start(info)
    check_settings(tmp_path, dict(info))  # the same: fine
    with pytest.raises(UserError, match=r"settings.fps: 2.0 there, 1.0 now"):
        check_settings(tmp_path, dict(info, settings={"fps": 1.0}))
    # a setting added after the folder was written: its default reads as what made those numbers
    later = dict(info, settings={"fps": 2.0, "zoom_list_tools": True})
    check_settings(tmp_path, later, defaults={"settings": {"zoom_list_tools": True}})
    with pytest.raises(UserError, match=r"settings.zoom_list_tools: True there, False now"):
        check_settings(tmp_path, dict(later, settings={"fps": 2.0, "zoom_list_tools": False}),
                       defaults={"settings": {"zoom_list_tools": True}})
    with pytest.raises(UserError, match=r"settings.zoom_list_tools: None there, True now"):  # no default given
        check_settings(tmp_path, later)


def _main(args, capsys):
    from mmpg.cli import main

    code = main(["eval"] + args)
    return code, capsys.readouterr().err.strip().splitlines()


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, tiny_dirs):
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({"v": {"duration": 10, "timestamps": [[1, 2]], "sentences": ["a thing"]}}))
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_dirs["qwen2_5_vl"] / "config.json").read_text())
    cases = [
        (["--checkpoint", str(tmp_path / "missing"), "--annotations", str(ann)], "no checkpoint folder"),
        (["--checkpoint", str(broken), "--annotations", str(ann)], "cannot read the checkpoint's config"),
        (["--checkpoint", str(no_weights), "--annotations", str(ann)], "cannot load the checkpoint"),
        (["--checkpoint", str(tiny_dirs["qwen2"]), "--annotations", str(ann)], "needs a video model"),
        (["--checkpoint", str(broken), "--annotations", str(empty)], "the benchmark is empty"),
        (["--checkpoint", str(broken), "--annotations", str(tmp_path / "nope.json")], "not found"),
        (["--checkpoint", str(broken), "--annotations", str(ann), "fsp=1"], "unknown eval setting 'fsp'"),
        (["--annotations", str(ann)], "pass --checkpoint"),
        (["--run", str(tmp_path), "--annotations", str(ann)], "is not a run directory"),
    ]
    for args, message in cases:
        code, err = _main(args + ["--out", str(tmp_path / "out")] if "--run" not in args else args, capsys)
        assert code == 2 and len(err) == 1 and err[0].startswith("mmpg: error:") and message in err[0], (args, err)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_timelens_protocol_names_its_settings(tmp_path):
    """TimeLens-Bench's protocol: each value from TencentARC/TimeLens's evaluation code or marked assumed."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Please find the visual event '{query}'.")
    with pytest.raises(UserError, match="GROUNDER_PROMPT"):
        load_settings("timelens")
    s = load_settings("timelens", [f"prompt_file={prompt}"])
    assert (s.format, s.scoring, s.threshold_rule, s.fps, s.min_tokens, s.total_tokens, s.max_new_tokens) == \
        ("timelens", "timelens", "ge", 2.0, 64, 14336, 512)
    source = PROTOCOLS["timelens"].source
    for text in ("eval_timelens_bench.sh", "compute_metrics.py", "assumed", "Not reproduced", "tIoU >= m"):
        assert text in source, text
    assert "rankings" in PROTOCOLS["timelens"].summary
