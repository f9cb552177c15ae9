"""The inspector's data functions, without a browser: filters, table rows, timeline data, curves, response text,
caching and refresh, bad input, and the app's own path checks. The run directory and the evaluation folder are
written by the writers of `mmpg.runs` (tests/synthetic_run.py: make_small_run / make_eval_folder)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from urllib.parse import unquote

import pytest

from mmpg_app.answers import response_fate
from mmpg_app.curves import curve_frames, folded, long_frame
from mmpg_app.evals import EvalSource, headline_html, metrics_rows, prediction_rows, worst_first
from mmpg_app.frames import (
    decoded_items, event_frames, event_strip, event_times, frame_items, strip_html, thumbnail_items,
)
from mmpg_app.groups import FILTERS, count_matches, filter_groups, parse_group_key, response_rows
from mmpg_app.render import split_response
from mmpg_app.run_source import RunSource
from mmpg_app.summary import ema, summary_html, trend
from mmpg_app.timeline import Bar, colour, frame_slots, nice_ticks, timeline_data, timeline_svg
from mmpg.errors import UserError
from mmpg.runs import GroupRecord, RunWriter, run_eval_dir
from synthetic_run import SMALL_EVAL, SMALL_GT, SMALL_SPANS, make_eval_folder, make_small_run, make_small_sft_run


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    run = make_small_run(root / "run", video_dir=root / "videos")
    evals = make_eval_folder(run_eval_dir(run, "charades", 3))
    return {"run": run, "eval": evals, "root": root}


def copy_run(small, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(small["run"], dst, symlinks=True)
    return dst


# --------------------------------------------------------------------------------------------- filters, rows
def test_filters_pick_the_known_groups(small):
    src = RunSource(small["run"])
    every = src.all_summaries()[0]
    assert [s.key for s in every] == ["1:0", "1:1", "2:0", "2:1", "3:0", "3:1"]
    assert [s.key for s in filter_groups(every, FILTERS[1])] == ["1:0"]  # all rewards equal
    # newest first, so the recent failures of a long run are the ones listed
    assert [s.key for s in filter_groups(every, FILTERS[2])] == ["3:1", "2:0", "1:1"]  # an answer without a span
    assert [s.key for s in filter_groups(every, FILTERS[3])] == ["2:0"]  # truncated
    lowest, highest = filter_groups(every, FILTERS[4]), filter_groups(every, FILTERS[5])
    assert lowest[0].key == "3:1" and highest[0].key == "3:0"
    assert [s.mean_reward for s in lowest] == sorted(s.mean_reward for s in every)
    assert [s.key for s in filter_groups(src.summaries(2), FILTERS[3])] == ["2:0"]  # "this step"
    assert [s.key for s in filter_groups(every, FILTERS[6])] == ["3:1", "2:1"]  # out of range or clamped
    assert [s.key for s in filter_groups(every, FILTERS[0], limit=2)] == ["3:0", "3:1"]  # the newest kept
    assert count_matches(every, FILTERS[2]) == 3 and count_matches(every, FILTERS[0]) == 6
    with pytest.raises(UserError, match="unknown filter"):
        filter_groups(every, "nonsense")


def test_response_rows_show_each_response(small):
    g = RunSource(small["run"]).groups(2)[0]
    headers, rows = response_rows(g)
    assert headers == ["#", "start_s", "end_s", "answer", "overall", "format", "iou", "advantage", "length",
                       "finish"]
    assert [r[3] for r in rows] == ["ok", "ok", "truncated", "ok"]
    assert len(rows) == 4
    spans = [(r[1], r[2]) for r in rows]
    assert spans == [tuple(s) if s else (None, None) for s, _ in SMALL_SPANS[(2, 0)]]
    assert [r[-1] for r in rows] == ["stop", "stop", "length", "stop"]
    iou = headers.index("iou")
    # response 0: [1, 5] against [2, 6]: overlap 3, union 5
    assert rows[0][iou] == pytest.approx(0.6)
    assert rows[2][headers.index("overall")] == 0.0


def test_each_failure_is_named_with_the_raw_answer(small):
    src = RunSource(small["run"])
    g21, g31, g11 = src.groups(2)[1], src.groups(3)[1], src.groups(1)[1]
    clamped, outside = response_fate(g21.responses[3], g21.duration), response_fate(g31.responses[3], g31.duration)
    assert (clamped.label, clamped.raw, clamped.text()) == ("clamped", "16.0 to 24.0", "clamped from 16.0 to 24.0")
    assert (outside.label, outside.text()) == ("out of range", "out of range: 24.0 to 30.0")
    assert g31.responses[3].rewards["format"] == 1.0  # the format reward alone still pays it
    assert response_fate(g11.responses[2], g11.duration).label == "unparsed"
    assert response_fate(src.groups(2)[0].responses[2], 12.0).label == "truncated"
    assert response_fate(g21.responses[0], g21.duration).label == "ok"
    negative = g11.responses[0].__class__(text="<answer>-5 to -1</answer>", parsed_span=None, rewards={},
                                          advantage=0.0, length=3, finish_reason="stop")
    assert response_fate(negative, 20.0).label == "out of range"
    assert [s.out_of_range for s in src.summaries(2)] == [0, 1] and "1 out of range" in src.summaries(3)[1].label(1)


def test_group_keys_from_the_browser_are_checked():
    assert parse_group_key("12:3") == (12, 3)
    for bad in ("../x", "1:2:3", "", None, "1;2", "-1:0"):
        with pytest.raises(UserError):
            parse_group_key(bad)


def test_split_response_sets_think_and_answer_apart():
    assert split_response("<think>a b</think> <answer>1 to 2</answer>") == [("think", "a b"), ("answer", "1 to 2")]
    assert split_response("pre <answer>x</answer> post") == [("text", "pre "), ("answer", "x"), ("text", " post")]
    assert split_response("<think>cut short") == [("think", "cut short")]  # truncated: the tag runs to the end
    assert split_response("") == [("text", "")]


# ---------------------------------------------------------------------------------------------- timeline
def test_timeline_data_places_every_span(small):
    g = RunSource(small["run"]).groups(2)[1]
    bars = [Bar(f"#{i}", r.parsed_span, r.rewards["iou"]) for i, r in enumerate(g.responses)]
    data = timeline_data(g.gt_span, g.duration, bars)
    assert data["axis_max"] == 20.0 and data["gt"] == SMALL_GT[1]
    assert [(r["x0"], r["x1"]) for r in data["rows"]] == [tuple(s) for s, _ in SMALL_SPANS[(2, 1)]]
    assert data["ticks"][0] == 0 and data["ticks"][-1] <= 20.0
    # response 0 matches the truth exactly (tIoU 1), response 1 misses it (tIoU 0): one absolute scale, 0 red, 1 green
    best, worst = data["rows"][0]["colour"], data["rows"][1]["colour"]
    assert (best, worst) == (colour(1.0), colour(0.0)) == ("#1a9850", "#d73027")
    assert (data["low"], data["high"]) == (0.0, 1.0)
    svg = timeline_svg(data)
    assert svg.count('class="span-bar"') == 4 and svg.count('class="gt-bar"') == 1
    assert re.findall(r'class="bar-value"[^>]*>([\d.]+)<', svg) == ["1.00", "0.00", "0.21", "0.00"]


def test_timeline_unparsed_reversed_and_overlong_spans():
    data = timeline_data([1.0, 2.0], 10.0, [Bar("a", None, 0.0), Bar("b", [6.0, 4.0], 1.0), Bar("c", [8.0, 14.0],
                                                                                                 math.nan)])
    a, b, c = data["rows"]
    assert a["note"] == "unparsed" and a["x0"] is None
    assert (b["x0"], b["x1"], b["note"]) == (4.0, 6.0, "reversed span")
    assert data["axis_max"] == 14.0 and c["colour"] == "#9e9e9e"  # axis grows to the longest span; NaN is grey
    assert timeline_svg(data).count('class="span-bar"') == 2
    assert colour(0.0, 0.0, 1.0) == "#d73027" and colour(1.0, 0.0, 1.0) == "#1a9850"
    assert nice_ticks(25.2) == [0, 5, 10, 15, 20, 25] and nice_ticks(0.0) == [0.0]


# ----------------------------------------------------------------------------------------------- summary
def test_summary_trend_by_hand():
    records = [{"step": s, "reward/mean": float(s)} for s in range(1, 11)]
    t = trend(records, "reward/mean", window=20)  # 10 points: window 5; last 5 mean 8, the 5 before mean 3
    assert (t["window"], t["now"], t["change"]) == (5, 8.0, 5.0)
    assert trend(records[:1], "reward/mean")["change"] is None and trend(records, "reward/iou") is None
    assert ema([0.0, 1.0, 1.0], 0.5) == [0.0, 0.5, 0.75]


def test_summary_of_a_grpo_and_an_sft_run(small, tmp_path):
    src = RunSource(small["run"])
    page = summary_html(src.metrics(), src.eval_metrics(), kind="grpo")
    for name in ("reward", "tIoU", "parse rate", "zero-advantage groups", "evaluation"):
        assert f'data-metric="{name}"' in page
    # eval.jsonl: step 1 (mIoU 0.1) is the start, step 3 (0.3) the latest
    assert re.search(r"<td>mIoU</td><td><b>0.300</b></td><td>0.100</td><td class='mmpg-up'>\+0.200", page)
    sft = RunSource(make_small_sft_run(tmp_path / "sft"))
    page = summary_html(sft.metrics(), sft.eval_metrics(), kind=sft.reader().info()["kind"])
    assert "SFT run" in page and 'data-metric="loss"' in page and 'data-metric="reward"' not in page
    assert re.search(r'mmpg-change mmpg-up"[^>]*>▼', page)  # the loss fell: good news, pointing down
    assert "<td>R1@0.7</td><td><b>0.300</b></td><td>0.020</td>" in page
    folder_only = summary_html([], [], [(3, {"miou": 0.4, "r1@0.5": 0.5})])  # no eval.jsonl: evaluation folders
    assert "<td>mIoU</td><td><b>0.400</b></td>" in folder_only and "no training metrics logged yet" in folder_only


# ------------------------------------------------------------------------------------------- event frames
def test_event_times_by_hand():
    # truth [10, 16] in 20 s: pad 3 -> 7, 10, 13, 16, 19; the span [16, 20]: 16 (the truth's), 18, 20
    assert event_times([10.0, 16.0], [16.0, 20.0], 20.0) == [
        (7.0, "around"), (10.0, "truth"), (13.0, "truth"), (16.0, "truth"), (18.0, "pred"), (19.0, "around"),
        (20.0, "pred")]
    assert event_times([0.0, 1.0], None, 4.0) == [(0.0, "truth"), (0.5, "truth"), (1.0, "truth"), (2.0, "around")]
    left = frame_slots([100.0, 105.0, 110.0, 890.0], 900.0, w=100.0, gap=4.0)  # crowded, and one at the edge
    assert left == [50.0, 154.0, 258.0, 800.0]
    assert all(b - a >= 104.0 for a, b in zip(left, left[1:]))


def test_every_group_of_the_first_step_has_a_frame_inside_the_truth(small):
    src = RunSource(small["run"])
    for g in src.groups(1):  # position 0: stored thumbnails only; position 1: decoded from the video file
        frames, note = event_frames(src.reader(), g.media_key, g.video, g.gt_span, g.responses[0].parsed_span,
                                    g.duration)
        inside = [t for _, t, kind in frames if kind == "truth"]
        assert inside and all(g.gt_span[0] <= t <= g.gt_span[1] for t in inside), (g.video, frames, note)
    g = src.groups(1)[1]
    frames, _ = event_frames(src.reader(), g.media_key, g.video, g.gt_span, [9.0, 15.0], g.duration)
    assert [round(t, 2) for _, t, _ in frames] == [7.0, 9.0, 10.0, 12.0, 13.0, 15.0, 16.0, 19.0]
    svg = timeline_svg(timeline_data(g.gt_span, g.duration, []), frames=[("x.jpg", 13.0, "truth")])
    assert 'x2="475.0"' in svg  # the leader line ends at 13 s on the axis: 70 + 810 * 13 / 20
    thumbs, _ = event_frames(src.reader(), None, "/no/such/video.mp4", [2.0, 6.0], None, 12.0)
    assert thumbs == []
    g0 = src.groups(1)[0]  # no video file: the stored thumbnails between 0 and 8 s (truth 2-6 s, pad 2 s)
    items, note = event_strip(src.reader(), g0.media_key, g0.video, g0.gt_span, g0.duration)
    assert [c for _, c in items] == ["1.5 s", "4.5 s", "7.5 s"] and "instead" in note
    items, note = event_strip(src.reader(), g.media_key, g.video, g.gt_span, g.duration, count=4)
    assert [c for _, c in items] == ["7.0 s", "11.0 s · truth", "15.0 s · truth", "19.0 s"] and note == ""


# ------------------------------------------------------------------------------------------------ curves
def test_curves_from_metrics_and_eval_lines(small):
    src = RunSource(small["run"])
    frames = curve_frames(src.metrics(), src.eval_metrics())
    assert set(frames["reward"]["series"]) == {"mean", "format", "parsed"}  # the legend without the prefix
    assert list(frames["iou"]["step"]) == [1, 2, 3]
    assert list(frames["kl"]["value"]) == pytest.approx([0.001, 0.002, 0.003])
    assert set(frames["timing"]["series"]) == {"rollout", "update"}
    assert set(frames["eval"]["series"]) == {"miou", "r1@0.5"}
    # identical series drawn once; smoothing (EMA w = 0.5: 1, 2, 4 -> 1, 1.5, 2.75); log10 leaves out values <= 0
    recs = [{"step": i, "reward/accuracy": v, "reward/iou_v2": v, "actor/kl": 0.0, "actor/clip_fraction": 0.0}
            for i, v in ((1, 1.0), (2, 2.0), (3, 4.0))]
    frames = curve_frames(recs, [], smoothing=0.5)
    assert set(frames["reward"]["series"]) == {"accuracy = iou_v2"}
    assert list(frames["reward"]["value"]) == [1.0, 1.5, 2.75]
    assert list(long_frame(recs + [{"step": 4, "x": 0.0}, {"step": 5, "x": 100.0}], ["x"], log=True)["value"]) == [2.0]
    empty, zero = folded(recs, [])
    assert zero == [("KL to the reference", ["actor/kl"]), ("Clip fraction", ["actor/clip_fraction"])]
    assert "tIoU" in empty and "Held-out evaluation during training" in empty and "Reward" not in empty
    records = [{"step": i, "x": float(i)} for i in range(10_001)]
    thin = long_frame(records, ["x"], max_points=1000)
    assert len(thin) <= 1001 and thin["step"].iloc[-1] == 10_000 and thin["step"].iloc[0] == 0


def test_the_data_wait_is_drawn_beside_the_phases_and_against_the_step():
    """timing_s/data heads the phases (in the order a step runs them, the whole step last), has a panel of its own
    against the step, and the videos read per step one too; a run without it folds that panel into the note."""
    recs = [{"step": i, "timing_s/update": 2.0, "timing_s/rollout": 3.0, "timing_s/data": 0.5 * i,
             "timing_s/weight_sync": 0.1, "timing_s/step": 6.0 + i, "data/videos_decoded": 4.0 - i,
             "data/videos_cached": float(i), "data/frames_decoded_max": 8.0 * i} for i in (1, 2, 3)]
    frames = curve_frames(recs, [])
    order = list(dict.fromkeys(frames["timing"]["series"]))
    assert order == ["data", "rollout", "update", "weight_sync", "step"]
    wait = frames["data_wait"]
    assert list(wait[wait["series"] == "data"]["value"]) == [0.5, 1.0, 1.5]
    assert list(wait[wait["series"] == "step"]["value"]) == [7.0, 8.0, 9.0]
    assert set(wait["series"]) == {"data", "step"}
    videos = frames["videos"]
    assert list(videos[videos["series"] == "decoded"]["value"]) == [3.0, 2.0, 1.0]
    assert list(videos[videos["series"] == "cached"]["value"]) == [1.0, 2.0, 3.0]
    assert list(frames["frames"]["value"]) == [8.0, 16.0, 24.0] and set(frames["frames"]["series"]) == \
        {"frames_decoded_max"}
    older = [{k: v for k, v in r.items() if not k.startswith("data/") and k != "timing_s/data"} for r in recs]
    assert curve_frames(older, [])["data_wait"].empty
    empty, _ = folded(older, [])
    assert "Data wait (does decoding keep up?)" in empty and "Videos read" in empty and "Time per phase" not in empty
    assert "Frames decoded (busiest rank)" in empty


# ----------------------------------------------------------------------------------------------- compare
def test_compare_finds_runs_and_overlays_them(small, tmp_path):
    from mmpg_app.compare import compare_rows, find_runs, overlay

    parent = tmp_path / "runs"
    shutil.copytree(small["run"], parent / "grpo", symlinks=True)
    make_small_sft_run(parent / "sft")
    (parent / "notes").mkdir()  # not a run: left out
    runs = find_runs([parent])
    assert list(runs) == ["grpo", "sft"]
    assert list(find_runs([parent / "sft", parent / "grpo"])) == ["sft", "grpo"]  # in the order given
    headers, rows = compare_rows(runs)
    row = {r[0]: dict(zip(headers, r)) for r in rows}
    assert row["grpo"]["kind"] == "grpo" and row["grpo"]["eval step"] == 3 and row["grpo"]["mIoU"] == 0.3
    assert row["sft"]["loss"] is not None and row["sft"]["reward"] is None and row["sft"]["R1@0.7"] == 0.3
    frame = overlay(runs, "eval/miou")
    assert sorted(set(frame["series"])) == ["grpo", "sft"]
    assert list(frame[frame["series"] == "sft"]["value"]) == [0.12, 0.586]
    assert list(overlay(runs, "eval/miou", smoothing=0.9)["value"]) == list(frame["value"])  # evaluations unsmoothed
    assert set(overlay(runs, "reward/mean")["series"]) == {"grpo"}
    with pytest.raises(UserError, match="neither a run directory nor a folder holding any"):
        find_runs([parent / "notes"])


# ----------------------------------------------------------------------------------------------- evaluations
def test_eval_status_names_the_failure():
    from mmpg_app.evals import status
    from mmpg.runs import PredictionRecord

    def rec(text, pred):
        return PredictionRecord(index=0, sample_id="s", video="v.mp4", duration=10.0, query="q", gt_span=[1.0, 2.0],
                                pred_span=pred, text=text, iou=0.0)
    assert status(rec("<answer>12 to 16</answer>", None)) == "out of range: 12 to 16"
    assert status(rec("<answer>4 to 12</answer>", [4.0, 10.0])) == "clamped from 4 to 12"
    assert status(rec("<answer>no idea</answer>", None)) == "unparsed"
    assert status(rec("<answer>4 to 6</answer>", [4.0, 6.0])) == "ok"


def test_eval_headline_puts_r1_first():
    metrics = {"v": 1, "count": 10, "failed": 0, "miou": 0.41, "r1@0.7": 0.2, "r1@0.3": 0.7, "r1@0.5": 0.5}
    assert [k for k, _ in metrics_rows(metrics)] == ["r1@0.3", "r1@0.5", "r1@0.7", "miou", "count", "failed"]
    assert re.findall(r'data-metric="([^"]+)"', headline_html(metrics)) == ["r1@0.3", "r1@0.5", "r1@0.7", "miou"]
    assert headline_html({}) == ""


def test_eval_rows_worst_first(small):
    src = EvalSource(small["eval"])
    records = src.predictions()
    assert [r.index for r in worst_first(records)] == [4, 2, 3, 1, 0]  # failed, unparsed, missed, partial, exact
    headers, rows = prediction_rows(records)
    assert len(rows) == len(SMALL_EVAL)
    assert rows[0][headers.index("status")].startswith("failed")
    assert rows[-1][headers.index("iou")] == 1.0
    assert [p.name for p in src.plots()] == ["iou_histogram.png"]


# ----------------------------------------------------------------------------------------- frames and media
def test_frames_from_thumbnails_or_decoded_or_a_note(small):
    src = RunSource(small["run"])
    g0, g1 = src.groups(1)
    items, note = frame_items(src.reader(), g0.media_key, g0.video)
    assert len(items) == 4 and note == "" and [c for _, c in items] == ["1.5 s", "4.5 s", "7.5 s", "10.5 s"]
    assert all(p.is_relative_to(small["run"].resolve()) for p, _ in items)
    items, note = frame_items(src.reader(), g1.media_key, g1.video)  # no thumbnails, the video exists
    assert len(items) == 8 and items[0][0].shape[2] == 3 and "decoded" in note
    assert strip_html(items).count('src="data:image/jpeg;base64,') == 8  # decoded frames are inlined
    items, note = decoded_items("/no/such/video.mp4")
    assert items == [] and note == "video file not available: /no/such/video.mp4"
    items, _ = frame_items(src.reader(), g0.media_key, g0.video)
    urls = re.findall(r'src="gradio_api/file=([^"]+)"', strip_html(items))
    assert len(urls) == 4 and all(unquote(u).startswith(str(small["run"].resolve()) + "/media/") for u in urls)


def test_missing_thumbnail_and_symlinks_out_are_reported(small, tmp_path):
    run = copy_run(small, tmp_path)
    src = RunSource(run)
    key = src.groups(1)[0].media_key
    (run / "media" / key / "frame_01.jpg").unlink()
    items, note = thumbnail_items(src.reader(), key)
    assert len(items) == 3 and note == f"1 of 4 thumbnails missing under media/{key}"
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(b"not for the browser")
    (run / "media" / key / "frame_02.jpg").unlink()
    os.symlink(secret, run / "media" / key / "frame_02.jpg")
    items, note = thumbnail_items(src.reader(), key)
    assert items == [] and "outside the run directory" in note
    items, note = thumbnail_items(src.reader(), "../../etc")
    assert items == [] and "not a media key" in note


def test_eval_plots_symlinked_out_are_left_out(small, tmp_path):
    folder = tmp_path / "ev"
    shutil.copytree(small["eval"], folder)
    (tmp_path / "outside.png").write_bytes(b"x")
    os.symlink(tmp_path / "outside.png", folder / "plots" / "leak.png")
    assert [p.name for p in EvalSource(folder).plots()] == ["iou_histogram.png"]


# ---------------------------------------------------------------------------------- cache, refresh, bad input
def test_cache_follows_the_files(small, tmp_path):
    run = copy_run(small, tmp_path)
    src = RunSource(run)
    first = src.groups(3)
    assert src.groups(3) is first  # unchanged file: parsed once
    g = first[0]
    changed = GroupRecord(**{**{k: getattr(g, k) for k in ("step", "group_index", "sample_id", "video", "duration",
                                                         "query", "gt_span", "media_key")}, "responses": []})
    RunWriter(run, tensorboard=False).write_rollouts(3, [changed])  # a resumed run rewrites a step
    assert len(src.groups(3)) == 1 and src.summaries(3)[0].size == 0
    RunWriter(run, tensorboard=False).write_rollouts(4, [changed])  # a new step while the app is open
    assert src.steps() == [1, 2, 3, 4]


def test_truncated_last_lines_are_skipped(small, tmp_path):
    run = copy_run(small, tmp_path)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"v": 1, "step": 4, "reward/me')
    with open(run / "rollouts" / "step_00000003.jsonl", "ab") as f:
        f.write(b'{"v": 1, "step": 3, "group_ind')
    src = RunSource(run)
    assert [m["step"] for m in src.metrics()] == [1, 2, 3]
    assert len(src.groups(3)) == 2


def test_bad_folders_give_a_message_not_a_crash(tmp_path, small):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "not a run directory" in RunSource(empty).problem()
    newer = copy_run(small, tmp_path)
    info = json.loads((newer / "run.json").read_text())
    (newer / "run.json").write_text(json.dumps({**info, "layout_version": 99}))
    assert "upgrade mmpg" in RunSource(newer).problem()
    # an older run directory: no run.json, records without media_key
    old = tmp_path / "old"
    (old / "rollouts").mkdir(parents=True)
    shutil.copy(small["run"] / "metrics.jsonl", old)
    lines = (small["run"] / "rollouts" / "step_00000001.jsonl").read_text().splitlines()
    stripped = [json.dumps({k: v for k, v in json.loads(x).items() if k != "media_key"}) for x in lines]
    (old / "rollouts" / "step_00000001.jsonl").write_text("\n".join(stripped) + "\n")
    src = RunSource(old)
    assert src.problem() is None and src.steps() == [1] and src.groups(1)[0].media_key is None


# --------------------------------------------------------------------------------- the handlers, no browser
@pytest.fixture
def views():
    """Build the page's components without serving it; handlers are then plain functions."""
    import gradio as gr

    from mmpg_app.eval_view import EvalView
    from mmpg_app.evals import run_evals
    from mmpg_app.run_view import RunView

    def make(run):
        with gr.Blocks():
            status, title, seen = gr.HTML(), gr.Markdown(), gr.State({})
            rv = RunView(RunSource(run), status, title, seen)
            ev = EvalView(lambda: run_evals(run), status)
            rv.build_summary()
            with gr.Tabs():
                rv.build()
                ev.build()
        return rv, ev

    return make


def test_load_pick_and_refresh_handlers(small, tmp_path, views):
    run = copy_run(small, tmp_path)
    rv, ev = views(run)
    out = rv.on_load(follow=False)
    assert out[rv.step]["value"] == 3 and out[rv.group]["value"] == "3:0"
    assert len(out[rv.table].data) == 4 and 'class="span-bar"' in out[rv.timeline]
    out = rv.on_pick(2, FILTERS[3], "this step")
    assert [v for _, v in out[rv.group]["choices"]] == ["2:0"]
    assert list(out[rv.table].data["finish"]) == ["stop", "stop", "length", "stop"]
    # the truncated response's row is tinted, and its text opens first
    assert "#fde2e1" in out[rv.table].to_html() and out[rv.response]["value"] == 2 and "truncated" in out[rv.text]
    out = rv.on_pick(3, FILTERS[2], "all steps")  # over the run: newest first, counted, the Step box follows
    assert out[rv.group]["value"] == "3:1" and out[rv.step] == 3 and "3 group(s) match of 6" in out[rv.picked]
    assert rv.on_group("1:1")[rv.step] == 1
    seen = {"steps": [1, 2, 3], "curves": True, "metrics": rv.src.metrics_key(), "alarm_key": rv.src.metrics_key()}
    assert set(rv.on_refresh(2, FILTERS[0], "this step", "2:0", seen, False)) == {rv.seen}  # nothing changed
    writer = RunWriter(run, tensorboard=False)
    writer.write_rollouts(4, RunSource(run).groups(1))
    writer.log_metrics(4, {"reward/mean": 0.5})
    out = rv.on_refresh(2, FILTERS[0], "this step", "2:0", seen, True)  # following: jumps to the new step
    assert out[rv.step]["value"] == 4 and out[rv.group]["value"] == "4:0" and rv.plots["reward"] in out
    assert 'data-metric="reward"' in out[rv.summary]  # the summary follows the new metrics
    assert out[rv.seen]["steps"] == [1, 2, 3, 4]
    text = rv.response_text("2:0", 2)
    assert "mmpg-think" in text and "truncated" in text
    out = ev.on_load()
    assert len(out[ev.table]) == 5 and out[ev.sample]["value"] == 4


def test_drift_alarm_shows_in_the_title(small, tmp_path, views):
    """A step the trainer flagged with alarm/logprob_drift puts one warning line under the run's title on the next
    refresh (not in the status line, which every pick clears), and it stays there."""
    run = copy_run(small, tmp_path)
    rv, _ = views(run)
    out = rv.on_load(follow=False)
    assert "logprob drift" not in out[rv.title]
    seen = out[rv.seen]
    assert rv.title not in rv.on_refresh(3, FILTERS[0], "this step", "3:0", seen, False)
    writer = RunWriter(run, tensorboard=False)
    writer.log_metrics(4, {"reward/mean": 0.5, "actor/logprob_gap_max": 0.31, "alarm/logprob_drift": 1.0})
    out = rv.on_refresh(3, FILTERS[0], "this step", "3:0", dict(seen), False)
    assert "**⚠ logprob drift: 1 step(s) flagged, the last at step 4" in out[rv.title] and "0.310" in out[rv.title]
    assert rv.status not in out
    assert rv.title not in rv.on_refresh(3, FILTERS[0], "this step", "3:0", out[rv.seen], False)  # sent once
    assert "logprob drift" in rv.title_md([1, 2, 3])  # and in every later title


def test_trainable_parameters_show_in_the_title(small, tmp_path, views):
    """run.json's "parameters" (what the trainer counted, LoRA or not) is shown under the run's title; a run.json
    without it (older runs, eval folders) shows no such part."""
    run = copy_run(small, tmp_path)
    rv, _ = views(run)
    assert "trainable parameters" not in rv.title_md([1])
    info = json.loads((run / "run.json").read_text())
    text = "trainable parameters: 8.2K of 257.2K (3.2 %), LoRA r=4 on 28 modules"
    info["parameters"] = {"trainable": 8192, "total": 257248, "text": text,
                          "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "modules": 28}}
    (run / "run.json").write_text(json.dumps(info))
    assert text in rv.title_md([1])


def test_handlers_turn_errors_into_messages(small, tmp_path, views):
    from mmpg_app.guard import guarded

    run = copy_run(small, tmp_path)
    path = run / "rollouts" / "step_00000002.jsonl"
    path.write_text("garbage\n" + path.read_text())  # a damaged line in the middle of a step file
    rv, ev = views(run)
    out = guarded(rv.status)(rv.on_pick)(2, FILTERS[0], "this step")
    assert "damaged line" in out[rv.status] and out[rv.table].empty  # no other step's group left on show
    out = guarded(rv.status)(rv.on_group)("9:0")
    assert "no rollouts for step 9" in out[rv.status]
    out = guarded(ev.status)(ev.on_pick)("/etc")
    assert "is not one of this run&#x27;s evaluation folders" in out[ev.status]
    empty = tmp_path / "empty"
    empty.mkdir()
    rv, _ = views(empty)
    out = rv.on_load()
    assert "not a run directory" in out[rv.status] and "fills in once the run writes" in out[rv.status]


def test_app_never_imports_the_trainer():
    code = ("import sys, mmpg_app.server, mmpg.bench.inspector_run; bad = sorted(m for m in sys.modules if "
            "m.startswith(('mmpg.rl', 'mmpg.train', 'deepspeed'))); print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_cli_defaults_to_localhost_and_refuses_a_missing_folder(tmp_path, capsys):
    from mmpg.cli import build_parser, main

    args = build_parser().parse_args(["inspect", str(tmp_path)])
    assert args.host == "127.0.0.1" and args.port is None
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------- rollout/training overlap
@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    """The small run with rollout.max_staleness = 2: staleness of (step, position) (1: 0, 0), (2: 1, 1), (3: 2, 1)."""
    return make_small_run(tmp_path_factory.mktemp("stale") / "run", max_staleness=2)


def test_an_asynchronous_run_names_the_weights_that_sampled_each_group(stale_run, views):
    rv, _ = views(stale_run)
    header = rv.group_view("3:1")[rv.header]
    assert "sampled by the weights after step 1 · 1 step stale" in header  # step 3 trained on version 1: 3 - 1 - 1
    assert "sampled by the initial weights · 2 steps stale" in rv.group_view("3:0")[rv.header]
    assert "sampled by the initial weights · 0 steps stale" in rv.group_view("1:0")[rv.header]
    assert "mmpg-error" not in header  # within rollout.max_staleness: no alarm
    summary = rv.summary_html()
    card = re.search(r'<div class="mmpg-card" data-metric="rollouts".*?</div></div>', summary).group(0)
    # step means 0, 1, 1.5 of rollout/staleness_mean: their mean 2.5 / 3 = 0.83; max 2 of rollout/staleness_max
    assert "up to 2 steps stale (mean 0.83)" in card and "max 2 steps" in card
    assert "mmpg-up" not in card and "mmpg-down" not in card  # staleness is no success, and here no failure
    out = rv.curves()
    frame = out[rv.plots["staleness"]]["value"]
    assert out[rv.plots["staleness"]]["y_title"] == "steps" and out[rv.cv.boxes["staleness"]]["visible"]
    assert set(frame["series"]) == {"staleness_mean", "staleness_max"}  # the legend without the prefix
    assert list(frame[frame["series"] == "staleness_mean"]["value"]) == pytest.approx([0.0, 1.0, 1.5])
    assert list(frame[frame["series"] == "staleness_max"]["value"]) == [0.0, 1.0, 2.0]


def test_a_synchronous_run_looks_as_before(small, tmp_path, views):
    """A run from before the overlap (no policy_version, no setting, no metric) and a synchronous one that records
    them (max_staleness 0, policy_version = step - 1): no staleness line on the group, "synchronous" on the card,
    the staleness panel folded away."""
    recorded = make_small_run(tmp_path / "sync", max_staleness=0)
    assert RunSource(recorded).groups(3)[0].policy_version == 2
    for run in (small["run"], recorded):
        rv, _ = views(run)
        header = rv.group_view("3:0")[rv.header]
        assert "sampled by" not in header and "stale" not in header
        summary = rv.summary_html()
        assert re.search(r'data-metric="rollouts".*?<b>synchronous</b>', summary)
        assert "steps stale" not in summary
        out = rv.curves()
        assert not out[rv.cv.boxes["staleness"]]["visible"]
    assert "Always 0, not drawn: Rollout staleness (overlap)" in out[rv.cv.curves_note]  # the recorded zeros
    src = RunSource(small["run"])
    assert "Rollout staleness (overlap)" in folded(src.metrics(), src.eval_metrics())[0]  # never logged
    sft = RunSource(make_small_sft_run(tmp_path / "sft"))
    assert 'data-metric="rollouts"' not in summary_html(sft.metrics(), [], kind="sft", rollouts="<div>x</div>")


def test_staleness_beyond_the_bound_or_from_newer_weights_is_an_error(stale_run):
    from mmpg_app.staleness import asynchronous, group_staleness_html, rollouts_card_html

    g = RunSource(stale_run).groups(3)[0]  # 2 steps stale
    assert "mmpg-error" not in group_staleness_html(g, 2, True)
    over = group_staleness_html(g, 1, True)
    assert 'class="mmpg-error' in over and "staler than the run's rollout.max_staleness = 1" in over
    newer = GroupRecord(**{**g.__dict__, "policy_version": 3})  # step 3 cannot train on weights after step 3
    assert newer.staleness == -1 and "the record is inconsistent" in group_staleness_html(newer, 2, True)
    assert group_staleness_html(g, 2, False) == ""
    # stale records are enough to call a run asynchronous, whatever its config and metrics say
    assert asynchronous(0, [], [g]) and not asynchronous(0, [{"step": 1, "rollout/staleness_max": 0.0}], [])
    card = rollouts_card_html(1, [{"step": 1, "rollout/staleness_mean": 1.0, "rollout/staleness_max": 3.0}])
    assert "up to 3 steps stale (mean 1.00)" in card and 'class="mmpg-down' in card and "mmpg-up" not in card
    assert "a group 3 steps stale: more than rollout.max_staleness = 1" in card
    assert "up to 2 steps stale</b>" in rollouts_card_html(2, [])  # configured, nothing logged yet


def test_a_zoom_trajectory_shows_its_turns_and_windows():
    """A multi-turn response (the zoom tool): its model turns in their parts, each tool turn as the window it showed
    (and its frames) or its error, the zoom count in its facts; its windows as grey rows on the group's timeline."""
    from mmpg.runs import ResponseRecord
    from mmpg_app.render import response_html
    from mmpg_app.run_view import zoom_bars

    turns = [{"model": "<think>look</think>\n<tool_call>{...}</tool_call>"}, {"zoom": [4.0, 8.5], "frames": 18},
             {"model": "<tool_call>bad</tool_call>"}, {"error": "the call is not JSON"},
             {"model": "<think>seen</think><answer>5.0 to 5.5</answer>"}]
    r = ResponseRecord(text=turns[-1]["model"], parsed_span=[5.0, 5.5], rewards={"overall": 1.0}, advantage=0.5,
                       length=90, finish_reason="stop", turns=turns)
    page = response_html(2, r)
    assert "1 zoom(s)" in page and "4.00 – 8.50 s, 18 frames" in page and "the call is not JSON" in page
    assert page.index("look") < page.index("4.00 – 8.50") < page.index("not JSON") < page.index("5.0 to 5.5")
    one = ResponseRecord(text="<answer>1 to 2</answer>", parsed_span=[1.0, 2.0], rewards={"overall": 1.0},
                         advantage=0.0, length=5, finish_reason="stop")
    bars = zoom_bars([one, r])
    assert [(b.label, b.span, b.value) for b in bars] == [("#1 z1", [4.0, 8.5], None)]
    data = timeline_data([5.0, 5.5], 20.0, bars)
    assert [(row["x0"], row["x1"]) for row in data["rows"]] == [(4.0, 8.5)]
    from mmpg.runs.evals import PredictionRecord
    from mmpg_app.eval_view import zoom_rows

    record = PredictionRecord(index=0, sample_id="s", video="v.mp4", duration=20.0, query="q", gt_span=[5.0, 5.5],
                              pred_span=[5.0, 5.5], text=turns[-1]["model"], iou=1.0, turns=turns)
    assert [(b.label, b.span, b.value) for b in zoom_rows(record)] == [("z1", [4.0, 8.5], None)]
