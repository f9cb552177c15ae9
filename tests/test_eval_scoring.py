"""Scoring as each protocol's paper scores (mmpg/eval/metrics.py), on hand-worked answers, and the papers' prompts
taken from the user's file (mmpg does not ship them)."""

from __future__ import annotations

import pytest

from mmpg.data.samples import GroundingSample
from mmpg.errors import UserError
from mmpg.eval.metrics import grounding_metrics, last_span, raw_iou, score_sample
from mmpg.eval.protocols import PROTOCOLS, eval_template
from mmpg.eval.settings import load_settings

OURS = 'In this {duration} s video, when does "{query}" happen? Answer as <answer>START to END</answer>.'


def _sample(span=(20.0, 30.0), duration=30.0, raw=None):
    kwargs = {"raw_span": raw} if raw is not None else {}
    return GroundingSample("v#0", "v.mp4", duration, "a person opens a door.", span, **kwargs)


@pytest.mark.parametrize("text, mmpg_iou, papers_iou", [
    # past the end: mmpg clamps 25-40 to 25-30 (5 / 10); the papers' IoU keeps 40 (inter 5, union 20-40 = 20)
    ("<answer>25 to 40</answer>", 0.5, 0.25),
    ("3 to 4", 0.0, 0.0),  # no tags: unparseable for mmpg; the papers parse it (and it misses 20-30: 0)
    ("the event spans 22 to 28 seconds", 0.0, 0.6),  # no tags: papers 6 / 10
    ("<answer>28 to 22</answer>", 0.0, 0.0),  # reversed: mmpg unparseable, papers' formula gives inter < 0 -> 0
    ("<think>maybe 0 to 5</think><answer>from 20 and 25</answer>", 0.5, 0.5),  # the last match, 'and' too
    ("first 20 to 30, finally 25 to 30", 0.0, 0.5),  # the papers take the last span anywhere
    ("<answer>20.00 to 30.00</answer>", 1.0, 1.0),
])
def test_each_scoring_against_hand_worked_answers(text, mmpg_iou, papers_iou):
    sample = _sample()
    assert score_sample(text, sample, "mmpg")[0].iou == pytest.approx(mmpg_iou)
    assert score_sample(text, sample, "last_span")[0].iou == pytest.approx(papers_iou)


def test_the_papers_score_the_raw_ground_truth():
    """A ground truth ending past the duration (Charades-STA's test file has 562): training and mmpg's default use
    the clamped span, the papers' protocols the file's own."""
    sample = _sample(span=(20.0, 30.0), duration=30.0, raw=(20.0, 31.0))
    scored, truth = score_sample("<answer>20 to 31</answer>", sample, "last_span")
    assert truth == (20.0, 31.0) and scored.iou == pytest.approx(1.0)
    scored, truth = score_sample("<answer>20 to 31</answer>", sample, "mmpg")
    assert truth == (20.0, 30.0) and scored.iou == pytest.approx(1.0)  # both clamped to the video
    assert score_sample("<answer>20 to 30</answer>", sample, "last_span")[0].iou == pytest.approx(10 / 11)


def test_parser_and_iou_pieces():
    assert last_span("no numbers here") is None
    assert last_span("3to4") is None  # the papers' pattern needs the spaces
    assert last_span("12.54 to 17.83") == (12.54, 17.83)
    assert last_span("-1 to 5") == (1.0, 5.0)  # no sign in the pattern, as in theirs
    assert raw_iou((0, 10), (5, 15)) == pytest.approx(5 / 15)
    assert raw_iou((7, 3), (3, 7)) == 0.0


def test_ties_at_the_thresholds_under_both_rules():
    """tIoU exactly 0.3, 0.5, 0.7 (whole-second spans in a 10 s truth): > counts none, >= counts each."""
    truth = (0.0, 10.0)
    preds = [(0.0, 3.0), (0.0, 5.0), (0.0, 7.0)]
    assert [raw_iou(p, truth) for p in preds] == pytest.approx([0.3, 0.5, 0.7])
    m = grounding_metrics(preds, [truth] * 3)
    assert (m["r1@0.3"], m["r1@0.5"], m["r1@0.7"]) == pytest.approx((2 / 3, 1 / 3, 0.0))  # 0.5, 0.7 > 0.3 ...
    assert (m["r1@0.3_ge"], m["r1@0.5_ge"], m["r1@0.7_ge"]) == pytest.approx((1.0, 2 / 3, 1 / 3))


@pytest.mark.parametrize("name", ["time_r1", "videochat_r1", "tvgbench"])
def test_papers_protocols_need_a_prompt_file(name, tmp_path):
    with pytest.raises(UserError) as err:
        load_settings(name)
    line = str(err.value)
    assert "\n" not in line and f"protocol {name} uses its paper's own prompt" in line and "prompt_file=PATH" in line
    assert PROTOCOLS[name].prompt_where in line and ".py" in PROTOCOLS[name].prompt_where
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(OURS)
    s = load_settings(name, [f"prompt_file={prompt}"])
    assert s.template == "file" and s.scoring == "last_span"
    template = eval_template(s.template, s.prompt_file, s.query_clean)  # their code keeps the final period
    assert template.render(_sample()) == ('In this 30.00 s video, when does "a person opens a door." happen? Answer '
                                          "as <answer>START to END</answer>.")


def test_bad_prompt_files_are_one_line(tmp_path):
    missing = tmp_path / "nope.txt"
    no_query = tmp_path / "a.txt"
    no_query.write_text("Where is it? {duration}")
    unknown = tmp_path / "b.txt"
    unknown.write_text("Find {query} in {video}")
    for path, words in ((missing, "not found"), (no_query, "no {query} placeholder"),
                        (unknown, "unknown placeholder {video}")):
        with pytest.raises(UserError, match=words):
            load_settings("time_r1", [f"prompt_file={path}"])


def test_default_protocol_keeps_mmpg_rules_and_a_prompt_file_selects_it(tmp_path):
    s = load_settings()
    assert (s.template, s.scoring, s.prompt_file) == ("time_r1", "mmpg", None)
    prompt = tmp_path / "p.txt"
    prompt.write_text(OURS)
    s = load_settings("default", [f"prompt_file={prompt}"])
    assert s.template == "file" and s.scoring == "mmpg"


def test_cli_without_a_prompt_file_exits_2(tmp_path, capsys):
    from mmpg.cli import main

    ann = tmp_path / "a.jsonl"
    ann.write_text('{"video": "v.mp4", "duration": 10, "query": "q", "span": [1, 2]}\n')
    code = main(["eval", "--checkpoint", str(tmp_path), "--annotations", str(ann), "--videos", str(tmp_path),
                 "--protocol", "videochat_r1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("mmpg: error: protocol videochat_r1 uses its paper's")
    assert not (tmp_path / "out").exists()


def test_report_says_how_much_of_the_benchmark_the_numbers_cover():
    """A Charades-STA-style file: 6 records, 1 absurd end and 1 start >= end left out, 2 ends past the duration kept;
    the report's Coverage section gives each count and the reasons (numbers folded), before the metrics' caveats."""
    from mmpg.eval.markdown import eval_report
    from mmpg.eval.runner import left_out_reasons

    left = [("a.json['v1'] sentence 2", "span 3-14220 s is not inside the video (duration 158 s) in sample v1#2"),
            ("a.json['v2'] sentence 0", "start 5 >= end 5 in sample v2#0")]
    reasons = left_out_reasons(left)
    assert reasons == {"span N-N s is not inside the video (duration N s)": 1, "start N >= end N": 1}
    info = {"benchmark": "a", "protocol": "time_r1", "annotations_records": 6, "benchmark_size": 4,
            "annotations_left_out_count": 2, "annotations_left_out": left, "annotations_left_out_reasons": reasons,
            "ground_truth_clamped": 2, "evaluated": 4, "settings": {"scoring": "last_span", "bad_videos": "fail"}}
    metrics = {"count": 4, "total": 4, "failed": 0, "unparseable_count": 0}
    report = eval_report(info, metrics, [])
    for text in ("## Coverage", "queries in the annotation file: **6**", "loaded: **4**; left out: **2**",
                 "1 x span N-N s is not inside the video (duration N s)", "1 x start N >= end N",
                 "ground truths ending past the stated duration, kept: **2**, scored against the file's own span",
                 "evaluated: **4**; scored: **4** (0 failed videos, scored 0)"):
        assert text in report, text


def _time_r1_iou(pred, gt):
    """Time-R1's compute_IoU (src/vllm_inference/eval_all.py) for one pair, rewritten here from its formula: numpy
    floats, intersection and union floored at 0, then divided (0 / 0 is NaN, with a warning)."""
    import numpy as np

    inter = np.maximum(0.0, np.minimum(pred[1], gt[1]) - np.maximum(pred[0], gt[0]))
    union = np.maximum(0.0, np.maximum(pred[1], gt[1]) - np.minimum(pred[0], gt[0]))
    with np.errstate(invalid="ignore"):
        return float(np.float64(inter) / np.float64(union))


@pytest.mark.parametrize("text, truth, iou, empty", [
    # TVGBench's zero-length Ego4D-NLQ moments, "85.83-85.83": every answer of positive length scores 0
    ("<answer>85 to 86</answer>", (85.83, 85.83), 0.0, False),  # contains the point: inter 0, union 1
    ("80.00 to 85.83", (85.83, 85.83), 0.0, False),  # ends on it: inter 0, union 5.83
    ("90 to 100", (85.83, 85.83), 0.0, False),  # elsewhere: inter 0, union 14.17
    ("85.83 to 85.83", (85.83, 85.83), 0.0, True),  # the same point: union 0; Time-R1 NaN, mmpg 0
    ("85.83 to 85.83", (10.0, 20.0), 0.0, False),  # a zero-length answer on a real moment: inter 0, union 75.83
    # the moment ending 4.85 s past its 27.9 s clip: scored against 7.37-32.75 as written, nothing clamped
    ("7.37 to 27.9", (7.37, 32.75), 20.53 / 25.38, False),
    ("7.37 to 32.75", (7.37, 32.75), 1.0, False),
    ("20 to 40", (7.37, 32.75), 12.75 / 32.63, False),
    # a reversed truth (start > end): inter <= 0, tIoU 0
    ("3 to 9", (9.1, 2.5), 0.0, False),
])
def test_degenerate_truths_scored_as_time_r1_scores_them(text, truth, iou, empty):
    from mmpg.eval.metrics import empty_union

    sample = GroundingSample("nlq#0", "v.mp4", 134.24, "where is the nut?", truth, as_written=True)
    scored, scored_against = score_sample(text, sample, "last_span")
    assert scored_against == truth and scored.iou == pytest.approx(iou, abs=1e-12)
    assert empty_union(scored.span, truth) == empty
    theirs = _time_r1_iou(scored.span, truth)
    assert (theirs != theirs) if empty else theirs == pytest.approx(scored.iou, abs=1e-12)  # NaN only there
    assert score_sample(text, sample, "timelens")[0].iou == pytest.approx(
        0.0 if empty else _time_r1_iou(tuple(float(round(x)) for x in scored.span), truth), abs=1e-12)


def test_tvgbench_denominators_under_the_papers_scoring():
    """The 5-record TVGBench copy loaded as `mmpg eval` loads it for last_span: all 5 in the denominators. Answers
    13.4-28.1 (exact), 9.94-45.94 (exact), 14.1-20 (exact), 85-86 on the zero-length moment, 7.37-27.9 on the late
    one: mIoU (1 + 1 + 1 + 0 + 0.8089) / 5 = 0.7618; R1@0.7 4/5. With the 2 left out (training's rule, mmpg's 788
    of 800) the same answers would give 3 / 3 = 1.0: the denominators differ as Time-R1's and mmpg's did."""
    import json as _json
    import tempfile
    from pathlib import Path

    from test_benchmark_files import tvgbench_list

    from mmpg.data.formats import load_annotations
    from mmpg.eval.metrics import benchmark_metrics

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tvgbench.json"
        path.write_text(_json.dumps(tvgbench_list()))
        samples = load_annotations(path, None, strict=False, keep_all=True).samples
    answers = ["13.4 to 28.1", "9.944375536211354 to 45.94437553621135", "14.1 to 20.0", "85 to 86", "7.37 to 27.9"]
    ious = [score_sample(a, s, "last_span")[0].iou for a, s in zip(answers, samples)]
    assert ious == pytest.approx([1.0, 1.0, 1.0, 0.0, 20.53 / 25.38])
    m = benchmark_metrics(ious, [False] * 5, [False] * 5)
    assert m["count"] == 5 and m["miou"] == pytest.approx((3 + 20.53 / 25.38) / 5)
    assert (m["r1@0.7"], m["r1@0.3"]) == pytest.approx((0.8, 0.8))


@pytest.mark.parametrize("text, span", [
    ("The event happens in 12.54 - 17.83 seconds.", (13.0, 18.0)),  # "A - B", rounded to whole seconds
    ("from 12.5 to 17.5", (12.0, 18.0)),  # halves to even, as Python's round
    ("0:05 - 1:02.4, then 3 - 4", (5.0, 62.0)),  # clock times first
    ("first 3 - 4, later 20 - 30", (3.0, 4.0)),  # the FIRST pair (Time-R1 takes the last)
    ("Start 2 seconds, end 9 seconds.", (2.0, 9.0)),  # any two numbers as the last resort
    ("1:00:01 to 1:00:09", (3601.0, 3609.0)),
    ("no numbers", None), ("only 7", None),
])
def test_timelens_parser(text, span):
    from mmpg.eval.metrics import timelens_span

    assert timelens_span(text) == span


def test_timelens_scoring_against_hand_worked_answers():
    """Truth 12.5-17.8 s. '12.54 - 17.83' becomes 13-18: inter 4.8, union 5.5 -> 0.8727 (last_span reads no 'to'
    here: unparseable). 'between 20 to 25' misses: 0. A tie: truth 0-10, answer '0 - 5' -> exactly 0.5, which
    TimeLens's R1@0.5 counts (>=)."""
    sample = _sample(span=(12.5, 17.8), duration=30.0)
    assert score_sample("The event happens in 12.54 - 17.83 seconds.", sample, "timelens")[0].iou == \
        pytest.approx(4.8 / 5.5)
    assert score_sample("The event happens in 12.54 - 17.83 seconds.", sample, "last_span")[0].span is None
    assert score_sample("between 20 to 25", sample, "timelens")[0].iou == 0.0
    none = score_sample("I cannot tell.", sample, "timelens")[0]
    assert (none.span, none.iou) == (None, 0.0) and "extract_time" in none.reason
    tie = score_sample("0 - 5", _sample(span=(0.0, 10.0), duration=10.0), "timelens")[0].iou
    m = grounding_metrics([(0.0, 5.0)], [(0.0, 10.0)])
    assert tie == 0.5 and (m["r1@0.5_ge"], m["r1@0.5"]) == (1.0, 0.0)


def test_coverage_names_what_the_papers_scoring_kept():
    """Under last_span the Coverage section counts the evaluated ground truths training would skip, by kind, and the
    answers whose union with the truth is empty (Time-R1's code: NaN)."""
    from types import SimpleNamespace

    from mmpg.eval.markdown import eval_report

    def rec(gt, pred, duration=134.24):
        return SimpleNamespace(gt_span=list(gt), pred_span=list(pred) if pred else None, duration=duration,
                               error=None, text="x", sample_id="s", index=0)

    records = [rec((85.83, 85.83), (85.83, 85.83)), rec((50.0, 50.0), (1.0, 2.0)), rec((7.37, 32.75), None, 27.9),
               rec((1.0, 2.0), (1.0, 2.0))]
    info = {"benchmark": "tvgbench", "protocol": "tvgbench", "annotations_records": 4, "benchmark_size": 4,
            "annotations_left_out_count": 0, "ground_truth_clamped": 0, "evaluated": 4,
            "settings": {"scoring": "last_span", "bad_videos": "skip"}}
    report = eval_report(info, {"count": 4, "total": 4, "failed": 0, "unparseable_count": 1}, records)
    for text in ("loaded: **4**; left out: **0**", "kept as written (the paper's loader keeps every record): **3**",
                 "  - 2 x zero-length", "  - 1 x ending more than max(2 s, 10 %) past the duration",
                 "a zero-length truth gives tIoU 0 to any answer of positive length",
                 "answers with an empty union with their ground truth (a zero-length answer on the same zero-length "
                 "truth): **1**, scored 0; Time-R1's compute_IoU gives NaN"):
        assert text in report, text
    info["settings"]["scoring"] = "mmpg"
    assert "kept as written" not in eval_report(info, {"count": 4, "total": 4}, records)
