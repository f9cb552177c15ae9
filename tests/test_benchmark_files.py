"""The public benchmark files' quirks, on small synthetic copies written here: which queries load, which are kept
with a clamped end (raw_span keeps the file's), which are skipped and why, and what `mmpg check-data` says.

The quirks are those counted in the real files (issue 21): Charades-STA's captions JSON ends up to 1.5 s past the
stated duration (562 of 3,720 test queries), float-rounding ends (TimeRFT, duration + 1e-14), TimeRFT's absurd ends
(14,220 s in a 158 s video) and ends 2-3 s past a 22 s video, reversed spans, starts past the duration, and
TVGBench's `path` / `question` / `answer: "S-E"` records. The rule (mmpg.data.samples): an end up to
max(2 s, 10 % of the duration) past it is kept and clamped; farther out, start >= end, or a start at/past the
duration is skipped.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmpg.data.check import check_dataset, format_report, run_check
from mmpg.data.dataset import GroundingDataset
from mmpg.data.formats import detect_format, load_annotations
from mmpg.data.samples import end_margin
from mmpg.data.video import VideoSpec
from batches import write_mp4
from mmpg.rl.step_log import group_summary, step_metrics

ROUNDED = 12.5 + 1e-14  # an end that is past 12.5 s by float rounding only
assert ROUNDED > 12.5


def charades_captions() -> dict:
    """Charades-STA in the captions JSON form (VideoChat-R1's charades_test.json): 10 queries.

    kept, clamped (raw_span set): 30.98 (+0.02), 32.46 (+1.5), 13.42 (+0.92), 21.1 (+1.1) -> 4, max 1.5 s
    kept, rounding only (raw_span None): 12.5 + 1e-14
    kept as is: [0, 7.2], [30, 45.5]
    skipped: 14,220 s in 158 s (margin 15.8 s), start 20.5 in a 20 s video, start 9.1 >= end 2.5 -> 3
    """
    return {
        "3MSZA": {"duration": 30.96, "timestamps": [[24.3, 30.98], [0.0, 7.2], [10.0, 32.46]],
                  "sentences": ["person turns a light on.", "a person puts a book away.", "person walks out."]},
        "AO8RW": {"duration": 12.5, "timestamps": [[2.5, 13.42], [5.0, ROUNDED]],
                  "sentences": ["person closes the door.", "the person sits down."]},
        "XK5ZV": {"duration": 158.0, "timestamps": [[120.0, 14220.0], [30.0, 45.5]],
                  "sentences": ["an end far past the video.", "person opens a bag."]},
        "Z1DR8": {"duration": 20.0, "timestamps": [[20.5, 21.0], [9.1, 2.5], [3.0, 21.1]],
                  "sentences": ["starts after the end.", "backwards.", "person eats a sandwich."]},
    }


def timerft_list() -> list:
    """TimeRFT (Time-R1's train_2k5.json) records, 7 of them, quirks from the real file."""
    base = "./dataset/timer1/videos/timerft_data/"

    def rec(i, video, duration, stamp):
        return {"video": base + video, "duration": duration, "timestamp": stamp, "sentence": f"query {i}",
                "qid": f"my|cosmo|{Path(video).stem}|query {i}", "video_start": None, "video_end": None,
                "difficulty": 50.0, "pred": [0.0, 3.0]}

    return [
        rec(0, "QtWT8rxUuNk.mp4", 93.29, [1.0, 4.0]),
        rec(1, "a_00:00:39:000_00:01:24:700.mp4", 45.7, [34.9, 41.9]),
        rec(2, "b.mp4", 22.2222, [10.0, 22.2222 + 1e-14]),  # rounding: kept, raw_span None
        rec(3, "c.mp4", 163.2, [150.0, 179.5]),  # 16.3 s past, margin 16.32 s: kept, clamped
        rec(4, "d.mp4", 22.2222, [20.0, 25.0]),  # 2.78 s past, margin 2.22 s: skipped
        rec(5, "e.mp4", 157.79096666666666, [120.0, 14220.0]),  # 14,062 s past: skipped
        rec(6, "f.mp4", 60.0, [0.0, 60.0]),
    ]


def tvgbench_list() -> list:
    """TVGBench (Time-R1's tvgbench.json) records, as in the file: `start` / `end` are where a clip was cut from its
    source video (end - start = duration), not the moment; 168 records have no `dataset_name`."""
    src = "./dataset/timer1/videos/annotations/tvgbench/raw_data/"
    path = "./dataset/timer1/videos/tvgbench_data/"

    def rec(video, question, answer, duration, source, start=None, end=None, **extra):
        return {"path": path + video, "question": question, "answer": answer, "start": start, "end": end,
                "duration": duration, "question_type": "video temporal grounding", "source": src + source, **extra}

    return [
        rec("KWZSA.mp4", "a person was sitting at a table.", "13.4-28.1", 30.12, "Charades_sta_test.json",
            dataset_name="charades", qsemtype="Human Pose",
            bins={"videolen": 1, "qcenter": 6, "qlen": 7, "dataset": "charades", "qsemtype": "HP"}),
        rec("aHDGMOQgHUE.mp4", "the man lifts the bar.", "9.944375536211354-45.94437553621135", 99.37,
            "anet_test.json", start=53.05562446378865, end=152.42562446378867, dataset_name="activitynet"),
        rec("EXYY8.mp4", "person closing the door behind them.", "14.1-20.0", 19.29, "Charades_sta_test.json",
            dataset_name="charades"),  # 0.71 s past: kept, clamped
        rec("s30-d52.mp4", "where is the nut before I picked a bolt?", "85.83-85.83", 134.24,
            "nlq_r1_val.json"),  # zero-length: start >= end, skipped (11 such in the real file)
        rec("s31-d53.mp4", "How many drawers did I open?", "7.37-32.75", 27.9,
            "nlq_r1_val.json"),  # 4.85 s past, margin 2.79 s: skipped
    ]


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data, indent=1))
    return path


def make_mp4(path: Path, frames: int, fps: int) -> Path:
    """A real H.264 mp4 of `frames / fps` seconds, 32x32 noise."""
    rng = np.random.default_rng(0)
    return write_mp4(path, (rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(frames)), fps)


@pytest.fixture(scope="module")
def charades_videos(tmp_path_factory) -> Path:
    """Videos whose lengths agree with the annotation durations (within check-data's max(1 s, 5 %))."""
    d = tmp_path_factory.mktemp("charades_videos")
    make_mp4(d / "3MSZA.mp4", 31, 1)  # 31 s for 30.96
    make_mp4(d / "AO8RW.mp4", 25, 2)  # 12.5 s
    make_mp4(d / "XK5ZV.mp4", 158, 1)  # 158 s
    make_mp4(d / "Z1DR8.mp4", 20, 1)  # 20 s
    return d


def test_margin_is_2_s_or_10_percent():
    assert end_margin(12.5) == 2.0 and end_margin(20.0) == 2.0 and end_margin(30.96) == pytest.approx(3.096)
    assert end_margin(158.0) == pytest.approx(15.8) and end_margin(22.2222) == pytest.approx(2.22222)


def test_charades_captions_every_sound_query_loads(tmp_path):
    path = write(tmp_path / "charades_test.json", charades_captions())
    assert detect_format(path) == "captions"
    res = load_annotations(path, None, strict=False)
    got = {s.sample_id: (s.span, s.raw_span) for s in res.samples}
    assert got == {
        "3MSZA#0": ((24.3, 30.96), (24.3, 30.98)), "3MSZA#1": ((0.0, 7.2), None),
        "3MSZA#2": ((10.0, 30.96), (10.0, 32.46)),
        "AO8RW#0": ((2.5, 12.5), (2.5, 13.42)), "AO8RW#1": ((5.0, 12.5), None),  # rounding: clamped, not recorded
        "XK5ZV#1": ((30.0, 45.5), None),
        "Z1DR8#2": ((3.0, 20.0), (3.0, 21.1)),
    }
    assert len(res.samples) == 7 and sum(s.raw_span is not None for s in res.samples) == 4
    reasons = {where.split("charades_test.json", 1)[1]: reason for where, reason in res.skipped}
    assert reasons == {
        "['XK5ZV'] sentence 0": "span 120-14220 s is not inside the video (duration 158 s, end 14062 s past it, "
                                "more than the 15.8 s allowed: max(2 s, 10% of the duration)) in sample XK5ZV#0",
        "['Z1DR8'] sentence 0": "span 20.5-21 s is not inside the video (duration 20 s, start at or past its end) "
                                "in sample Z1DR8#0",
        "['Z1DR8'] sentence 1": "start 9.1 >= end 2.5 in sample Z1DR8#1",
    }


def test_timerft_list(tmp_path):
    path = write(tmp_path / "train_2k5.json", timerft_list())
    assert detect_format(path) == "time_r1"
    res = load_annotations(path, tmp_path, strict=False)
    assert [s.sample_id.split("|")[2] for s in res.samples] == [
        "QtWT8rxUuNk", "a_00:00:39:000_00:01:24:700", "b", "c", "f"]  # 5 of 7
    b, c = res.samples[2], res.samples[3]
    assert (b.span, b.raw_span) == ((10.0, 22.2222), None)  # 1e-14 s past: rounding
    assert (c.span, c.raw_span) == ((150.0, 163.2), (150.0, 179.5))  # 16.3 s past, within 16.32 s
    assert c.meta == {"video_start": None, "video_end": None, "difficulty": 50.0, "pred": (0.0, 3.0)}
    assert [w.rsplit("[", 1)[1] for w, _ in res.skipped] == ["4]", "5]"]
    assert "end 2.78 s past it, more than the 2.22 s allowed" in res.skipped[0].reason
    assert res.skipped[1].reason.endswith("in sample my|cosmo|e|query 5")


def test_tvgbench_list(tmp_path):
    path = write(tmp_path / "tvgbench.json", tvgbench_list())
    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "KWZSA.mp4").write_bytes(b"x")
    assert detect_format(path) == "tvgbench"
    res = load_annotations(path, tmp_path / "videos", strict=False)
    assert [s.sample_id for s in res.samples] == ["Charades_sta_test_0", "anet_test_1", "Charades_sta_test_2"]
    first, cut, late = res.samples
    # ./dataset/timer1/videos/tvgbench_data/KWZSA.mp4 is not under the folder: found by its file name
    assert first.video == str(tmp_path / "videos" / "KWZSA.mp4")
    assert (first.query, first.span, first.duration, first.raw_span) == (
        "a person was sitting at a table.", (13.4, 28.1), 30.12, None)
    assert first.meta == {"start": None, "end": None, "question_type": "video temporal grounding",
                          "source": "./dataset/timer1/videos/annotations/tvgbench/raw_data/Charades_sta_test.json",
                          "dataset_name": "charades", "qsemtype": "Human Pose",
                          "bins": (("videolen", 1), ("qcenter", 6), ("qlen", 7), ("dataset", "charades"),
                                   ("qsemtype", "HP"))}
    hash(first)  # metadata is frozen: the sample stays hashable
    # the moment is `answer`; start / end (53.06-152.43, 99.37 s long) say where the clip was cut
    assert cut.span == pytest.approx((9.944375536211354, 45.94437553621135))
    assert cut.meta["start"] == pytest.approx(53.05562446378865) and "dataset_name" in cut.meta
    assert (late.span, late.raw_span) == ((14.1, 19.29), (14.1, 20.0))
    assert [(w.rsplit("[", 1)[1], r) for w, r in res.skipped] == [
        ("3]", "start 85.83 >= end 85.83 in sample nlq_r1_val_3"),
        ("4]", "span 7.37-32.75 s is not inside the video (duration 27.9 s, end 4.85 s past it, more than the "
               "2.79 s allowed: max(2 s, 10% of the duration)) in sample nlq_r1_val_4")]
    named = load_annotations(path, None, fmt="tvgbench", strict=False)
    assert [s.sample_id for s in named.samples] == [s.sample_id for s in res.samples]


def test_tvgbench_bad_answer_names_the_record(tmp_path):
    records = tvgbench_list()[:2]
    records[1]["answer"] = "about 10 s"
    path = write(tmp_path / "tvgbench.json", records)
    res = load_annotations(path, None, strict=False)
    assert [s.sample_id for s in res.samples] == ["Charades_sta_test_0"]
    assert res.skipped[0].where.endswith("tvgbench.json[1]")
    assert res.skipped[0].reason == "answer is 'about 10 s', expected 'START-END' in seconds, e.g. '13.4-28.1'"


def test_check_data_counts_notes_and_skips(tmp_path, charades_videos, capsys):
    path = write(tmp_path / "charades_test.json", charades_captions())
    report = check_dataset(path, charades_videos)
    assert (report.n_records, report.n_used, dict(report.skipped)) == (
        10, 7, {"outside_duration": 2, "start_ge_end": 1})
    assert [n.where.split("json", 1)[1] for n in report.notes] == [
        "['3MSZA'] sentence 0 (sample 3MSZA#0)", "['3MSZA'] sentence 2 (sample 3MSZA#2)",
        "['AO8RW'] sentence 0 (sample AO8RW#0)", "['Z1DR8'] sentence 2 (sample Z1DR8#2)"]
    assert dict(report.counts()) == {"outside_duration": 2, "start_ge_end": 1}  # notes are not problems
    text = format_report(report)
    assert "queries: 10 in the file, 7 will be used (trained on / evaluated), 3 skipped" in text
    assert "  skipped, spans with start >= end: 1\n  skipped, spans outside the video: 2" in text
    assert "note: ends past the duration (kept, clamped for training): 4, max 1.5 s" in text
    assert ("(sample 3MSZA#2): span 10-32.46 s ends 1.5 s after the duration (30.96 s); trained on 10-30.96 s"
            in text)
    assert "3 problems found" in text
    assert run_check(path, charades_videos) == 1
    capsys.readouterr()


def test_check_data_notes_only_exit_0(tmp_path, charades_videos, capsys):
    data = charades_captions()
    del data["XK5ZV"]["timestamps"][0], data["XK5ZV"]["sentences"][0]
    data["Z1DR8"] = {"duration": 20.0, "timestamps": [[3.0, 21.1]], "sentences": ["person eats a sandwich."]}
    path = write(tmp_path / "charades_kept.json", data)
    assert run_check(path, charades_videos) == 0
    out = capsys.readouterr().out
    assert "queries: 7 in the file, 7 will be used (trained on / evaluated), 0 skipped" in out
    assert "note: ends past the duration (kept, clamped for training): 4, max 1.5 s" in out
    assert out.rstrip().endswith("OK: no problems found (4 notes)")


def test_dataset_clamps_to_the_file_duration(tmp_path, charades_videos):
    # Charades-STA text has no durations: the dataset reads 12.5 s from the file and clamps 13.42 there
    ann = tmp_path / "charades_sta_test.txt"
    ann.write_text("AO8RW 2.5 13.42##person closes the door.\nAO8RW 2.5 15.0##too late.\n")
    samples = load_annotations(ann, charades_videos).samples
    assert [s.raw_span for s in samples] == [None, None]  # no duration yet
    ds = GroundingDataset(samples, VideoSpec(fps=1.0, max_frames=4, min_pixels=4 * 28 * 28, max_pixels=4 * 28 * 28))
    kept, late = ds[0], ds[1]
    assert kept.ok and (kept.sample.span, kept.sample.raw_span) == ((2.5, 12.5), (2.5, 13.42))
    assert not late.ok and "end 2.5 s past it, more than the 2 s allowed" in late.error


def test_gt_clamped_metric_counts_the_steps_clamped_groups(tmp_path):
    samples = load_annotations(write(tmp_path / "a.json", charades_captions()), None, strict=False).samples

    def group(sample):
        return SimpleNamespace(sample=sample, rewards=[{"overall": 1.0}, {"overall": 0.0}],
                               completion_mask=torch.ones(2, 3), own_mask=None, finish_reasons=["stop", "stop"],
                               inputs={"input_ids": torch.zeros(1, 5)}, policy_version=0)

    summaries = [group_summary(group(s), 1) for s in samples]  # 7 groups, 4 with raw_span
    info = {"skipped": 0, "dropped_groups": 0, "rounds": 1, "timing": {"step": 1.0}}
    assert step_metrics(summaries, {}, [info], 0, "cpu")["data/gt_clamped"] == 4.0
    assert step_metrics(summaries[1:2], {}, [info], 0, "cpu")["data/gt_clamped"] == 0.0  # 3MSZA#1, inside



def test_papers_scoring_keeps_every_record_with_a_readable_span(tmp_path):
    """Evaluation under a paper's scoring (`keep_all`, what `mmpg eval` does for last_span and timelens) keeps what
    training skips, as the papers' loaders do: TVGBench 5 of 5 (the real file: 800 of 800), TimeRFT 7 of 7, the
    Charades-STA JSON 10 of 10. Spans the rule rejects stay as the file has them (raw_span None); sound ones are
    clamped as before. A record without a readable span is still left out."""
    tvg = load_annotations(write(tmp_path / "tvgbench.json", tvgbench_list()), None, strict=False, keep_all=True)
    assert tvg.skipped == [] and len(tvg.samples) == 5 and all(s.as_written for s in tvg.samples)
    zero, late = tvg.samples[3], tvg.samples[4]
    assert (zero.sample_id, zero.span, zero.raw_span) == ("nlq_r1_val_3", (85.83, 85.83), None)
    assert (late.sample_id, late.span, late.raw_span) == ("nlq_r1_val_4", (7.37, 32.75), None)
    assert (tvg.samples[2].span, tvg.samples[2].raw_span) == ((14.1, 19.29), (14.1, 20.0))  # within the margin
    for records, n in ((timerft_list(), 7), (charades_captions(), 10)):
        res = load_annotations(write(tmp_path / "f.json", records), None, strict=False, keep_all=True)
        assert (len(res.samples), res.skipped) == (n, [])
    unreadable = tvgbench_list()[:2]
    unreadable[1]["answer"] = "about 10 s"
    res = load_annotations(write(tmp_path / "u.json", unreadable), None, strict=False, keep_all=True)
    assert len(res.samples) == 1 and "expected 'START-END'" in res.skipped[0].reason
    # training loads without keep_all: the 2 are skipped, counted
    assert len(load_annotations(tmp_path / "tvgbench.json", None, strict=False).samples) == 3


def test_dataset_keeps_as_written_spans_once_it_reads_the_duration(tmp_path, charades_videos):
    """Charades-STA text has no durations: the dataset finds the problem when it reads the video (20 s). Loaded
    as written, the sample is kept with its span as in the file; loaded for training, it fails, counted."""
    ann = tmp_path / "charades_sta_test.txt"
    ann.write_text("Z1DR8 20.5 21.0##starts after the end.\nZ1DR8 3.0 3.0##zero length.\nZ1DR8 3.0 21.1##late.\n")
    spec = VideoSpec(fps=1.0, max_frames=4, min_pixels=4 * 28 * 28, max_pixels=4 * 28 * 28)
    kept = GroundingDataset(load_annotations(ann, charades_videos, keep_all=True).samples, spec)
    assert [(it.ok, it.sample.span, it.sample.raw_span, it.sample.duration) for it in kept.__getitems__([0, 1, 2])] \
        == [(True, (20.5, 21.0), None, 20.0), (True, (3.0, 3.0), None, 20.0), (True, (3.0, 20.0), (3.0, 21.1), 20.0)]
    trained = GroundingDataset(load_annotations(ann, charades_videos, strict=False).samples[:1], spec)
    assert not trained[0].ok and "start at or past its end" in trained[0].error
    from mmpg.data.formats import fill_durations

    filled = fill_durations(load_annotations(ann, charades_videos, keep_all=True).samples)
    assert [s.span for s in filled.samples] == [(20.5, 21.0), (3.0, 3.0), (3.0, 20.0)] and filled.skipped == []
