"""Annotation loaders on hand-written fixture files (tests/fixtures/data/), in every supported format."""

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from mmpg.data.formats import detect_format, load_annotations
from mmpg.data.samples import GroundingSample, resolve_video, span_problem
from mmpg.errors import UserError

FIX = Path(__file__).parent / "fixtures" / "data"
VIDEOS = Path("/videos")  # nothing needs to exist for loading; missing files are check-data's business


@pytest.mark.parametrize("name,fmt", [
    ("charades_sta.txt", "charades"), ("charades_sta.json", "captions"), ("activitynet_captions.json", "captions"),
    ("time_r1.json", "time_r1"), ("samples.jsonl", "jsonl"),
])
def test_detect_format(name, fmt):
    assert detect_format(FIX / name) == fmt


def test_detect_format_unknown(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    with pytest.raises(UserError, match=r"notes.txt: cannot tell the annotation format; pass --format"):
        detect_format(path)


def test_charades_txt():
    res = load_annotations(FIX / "charades_sta.txt", VIDEOS)
    assert res.skipped == []
    assert [s.sample_id for s in res.samples] == ["3MSZA#0", "3MSZA#1", "AO8RW#0", "XK5ZV#0"]
    first = res.samples[0]
    assert first == GroundingSample(sample_id="3MSZA#0", video="/videos/3MSZA.mp4", duration=None,
                                    query="person turn a light on.", span=(24.3, 30.4),
                                    origin=f"{FIX / 'charades_sta.txt'}:1")
    assert res.samples[3].origin.endswith("charades_sta.txt:5")  # blank line 4 skipped silently
    assert res.samples[3].span == (10.0, 14.75)


@pytest.mark.parametrize("name,ids", [
    ("charades_sta.txt", ["3MSZA#0", "3MSZA#1", "AO8RW#0", "XK5ZV#0"]),
    ("charades_sta.json", ["3MSZA#0", "3MSZA#1", "AO8RW#0"]),
    ("samples.jsonl", ["a1", "a2", "AO8RW#0"]),
])
def test_utf8_byte_order_mark_is_dropped(tmp_path, name, ids):
    # a file saved by a Windows editor starts with EF BB BF; the first id must not become "\ufeff3MSZA"
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + (FIX / name).read_bytes())
    assert detect_format(path) == detect_format(FIX / name)
    res = load_annotations(path, VIDEOS)
    assert [s.sample_id for s in res.samples] == ids and res.skipped == []
    assert res.samples[0].video == "/videos/3MSZA.mp4"
    plain = load_annotations(FIX / name, VIDEOS).samples
    assert [dataclasses.replace(s, origin="") for s in res.samples] == [
        dataclasses.replace(s, origin="") for s in plain]  # the same samples as without the mark


def test_charades_json_is_the_captions_form():
    res = load_annotations(FIX / "charades_sta.json", VIDEOS, fmt="charades_json")
    assert [(s.sample_id, s.duration, s.span) for s in res.samples] == [
        ("3MSZA#0", 30.96, (24.3, 30.4)), ("3MSZA#1", 30.96, (0.0, 7.2)), ("AO8RW#0", 12.5, (2.5, 9.1))]


def test_activitynet_one_sample_per_sentence():
    res = load_annotations(FIX / "activitynet_captions.json", VIDEOS, fmt="activitynet")
    assert [s.sample_id for s in res.samples] == ["v_QOlSCBRmfWY#0", "v_QOlSCBRmfWY#1", "v_QOlSCBRmfWY#2",
                                                  "v_ehGHCYKzyZ8#0", "v_ehGHCYKzyZ8#1"]
    s = res.samples[1]
    assert (s.duration, s.span, s.video) == (82.73, (17.37, 60.81), "/videos/v_QOlSCBRmfWY.mp4")
    assert s.query == "The girl dances around the room while the camera captures her movements."  # stripped
    assert res.samples[3].span == (0.0, 15.12)  # an int in the file becomes a float


def test_time_r1_list():
    res = load_annotations(FIX / "time_r1.json", "/data/charades")
    assert [(s.sample_id, s.video) for s in res.samples[:3]] == [
        ("3MSZA#0", "/data/charades/3MSZA.mp4"), ("3MSZA#1", "/data/charades/3MSZA.mp4"),
        ("custom-7", "/data/charades/sub/AO8RW.mkv")]  # an "id" field wins; paths keep their extension
    assert res.samples[2].duration == 12.5
    cut = res.samples[3]  # a Time-R1 record of an already cut clip: video_start/end are provenance, not a window
    assert (cut.sample_id, cut.span, cut.duration) == ("my|vtime|abcXYZ|a statue of a man on horseback",
                                                      (34.9, 41.9), 45.7)
    assert (cut.clip_start, cut.clip_end) == (None, None)


def test_relative_path_falls_back_to_file_name(tmp_path):
    clip = tmp_path / "abcXYZ_00:00:39:000_00:01:24:700.mp4"
    clip.write_bytes(b"x")
    res = load_annotations(FIX / "time_r1.json", tmp_path)
    assert res.samples[3].video == str(clip)  # ./dataset/timer1/videos/timerft_data/<name> not under tmp_path
    assert res.samples[2].video == str(tmp_path / "sub" / "AO8RW.mkv")  # neither exists: the path as written


def test_generic_jsonl():
    res = load_annotations(FIX / "samples.jsonl", VIDEOS)
    a1, a2, third = res.samples
    assert (a1.sample_id, a1.duration, a1.clip_start, a1.clip_end) == ("a1", 30.96, None, None)
    assert (a2.duration, a2.clip_start, a2.clip_end, a2.video) == (None, 0.0, 15.0, "/videos/3MSZA.mp4")
    assert (third.sample_id, third.origin.rsplit(":", 1)[1]) == ("AO8RW#0", "4")  # id from the video, line 4


def test_video_extension_resolution(tmp_path):
    (tmp_path / "a.mkv").write_bytes(b"x")
    (tmp_path / "b.webm").write_bytes(b"x")
    (tmp_path / "c.mp4").write_bytes(b"x")
    (tmp_path / "c.avi").write_bytes(b"x")  # .mp4 is tried first
    assert resolve_video(tmp_path, "a") == str(tmp_path / "a.mkv")
    assert resolve_video(tmp_path, "b") == str(tmp_path / "b.webm")
    assert resolve_video(tmp_path, "c") == str(tmp_path / "c.mp4")
    assert resolve_video(tmp_path, "missing") == str(tmp_path / "missing.mp4")  # reported later as missing
    assert resolve_video(tmp_path, "/abs/x.mov") == "/abs/x.mov"


def test_activitynet_ids_without_v_prefix(tmp_path):
    (tmp_path / "QOlSCBRmfWY.mkv").write_bytes(b"x")  # downloaded without the v_ prefix
    res = load_annotations(FIX / "activitynet_captions.json", tmp_path)
    assert res.samples[0].video == str(tmp_path / "QOlSCBRmfWY.mkv")


# --- bad input: strict raises naming the file and line / key; skip mode counts and logs ---

def test_charades_malformed_strict():
    with pytest.raises(UserError, match=r"charades_bad.txt:2: malformed line .*'VIDEO_ID START END##sentence'"):
        load_annotations(FIX / "charades_bad.txt", VIDEOS)


def test_charades_bad_lines_skipped(caplog):
    with caplog.at_level(logging.WARNING, logger="mmpg.data"):
        res = load_annotations(FIX / "charades_bad.txt", VIDEOS, strict=False)
    assert [s.sample_id for s in res.samples] == ["3MSZA#0", "XK5ZV#0"]
    lines = [where.rsplit(":", 1)[1] for where, _ in res.skipped]
    assert lines == ["2", "3", "4", "5"]
    reasons = [reason for _, reason in res.skipped]
    assert "malformed line" in reasons[0]
    assert "start 9.1 >= end 2.5 in sample AO8RW#0" in reasons[1]
    assert "start is 'abc'" in reasons[2]
    assert "sentence is ''" in reasons[3]
    assert "skipped 4 of 6 annotations" in caplog.text


def test_malformed_json_line_strict():
    with pytest.raises(UserError, match=r"samples_bad.jsonl:2: not valid JSON .*load with strict=False to skip"):
        load_annotations(FIX / "samples_bad.jsonl", VIDEOS)


def test_start_ge_end_strict(tmp_path):
    lines = (FIX / "samples_bad.jsonl").read_text().splitlines()
    path = tmp_path / "two.jsonl"
    path.write_text(lines[0] + "\n" + next(line for line in lines if '"reversed"' in line) + "\n")
    with pytest.raises(UserError, match=r"two.jsonl:2: start 5 >= end 2 in sample reversed; fix it, or load"):
        load_annotations(path, VIDEOS)


def test_jsonl_bad_lines_skipped():
    res = load_annotations(FIX / "samples_bad.jsonl", VIDEOS, strict=False)
    assert [s.sample_id for s in res.samples] == ["ok"]
    got = {where.rsplit(":", 1)[1]: reason for where, reason in res.skipped}
    assert "not valid JSON" in got["2"]
    assert "query is None" in got["3"]
    assert "span 31-40 s is not inside the video (duration 30.96 s, start at or past its end) in sample late" \
        in got["4"]
    assert "start 5 >= end 2" in got["5"]
    assert "span start is 'x'" in got["6"]
    assert "expected a JSON object" in got["7"]
    assert "clip 9-3 needs 0 <= start < end" in got["8"]


def test_span_outside_duration_strict():
    with pytest.raises(UserError, match=r"activitynet_bad.json\['v_good'\] sentence 1: span 30-40 s is not inside"):
        load_annotations(FIX / "activitynet_bad.json", VIDEOS)


def test_activitynet_bad_entries_skipped():
    res = load_annotations(FIX / "activitynet_bad.json", VIDEOS, strict=False)
    assert [(s.sample_id, s.span, s.raw_span) for s in res.samples] == [
        ("v_good#0", (1.0, 5.0), None), ("v_good#3", (2.0, 20.0), (2.0, 20.3))]  # 0.3 s past 20 s: clamped
    where = [w.split("activitynet_bad.json", 1)[1] for w, _ in res.skipped]
    assert where == ["['v_good'] sentence 1", "['v_good'] sentence 2", "['v_uneven']", "['v_notdict']",
                     "['v_badstamp'] sentence 0"]
    assert "start 6 >= end 6" in res.skipped[1].reason


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"video": "a.mp4",\n  oops\n]')
    with pytest.raises(UserError, match=r"broken.json:3: not valid JSON"):
        load_annotations(path, VIDEOS, fmt="time_r1")


def test_wrong_top_level_type(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"video": "a.mp4"}]))
    with pytest.raises(UserError, match="expected a JSON object"):
        load_annotations(path, VIDEOS, fmt="activitynet")


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(UserError, match=r"annotation file .*nope.txt not found"):
        load_annotations(tmp_path / "nope.txt", VIDEOS)
    with pytest.raises(UserError, match="unknown annotation format 'csv'"):
        load_annotations(FIX / "charades_sta.txt", VIDEOS, fmt="csv")


@pytest.mark.parametrize("span,duration,kind", [
    ((1.0, 2.0), None, None), ((1.0, 2.0), 2.0, None), ((1.0, 2.4), 2.0, None),
    ((1.0, 4.0), 2.0, None), ((1.0, 4.01), 2.0, "outside_duration"),  # short video: margin 2 s
    ((10.0, 110.0), 100.0, None), ((10.0, 110.01), 100.0, "outside_duration"),  # 100 s video: margin 10 %, 10 s
    ((2.0, 2.0), None, "start_ge_end"), ((3.0, 2.0), 9.0, "start_ge_end"), ((-1.0, 2.0), None, "outside_duration"),
    ((-1e-9, 2.0), None, None),  # float rounding below 0
    ((2.0, 2.4), 2.0, "outside_duration"), ((2.2, 2.4), 2.0, "outside_duration"),  # starts at / past the end
    ((float("nan"), 1.0), None, "bad_number"),
])
def test_span_problem(span, duration, kind):
    problem = span_problem(span, duration)
    assert (problem[0] if problem else None) == kind


def test_write_jsonl_round_trip(tmp_path):
    from mmpg.data.formats import write_jsonl

    original = load_annotations(FIX / "samples.jsonl", tmp_path).samples
    write_jsonl(original, tmp_path / "out.jsonl")
    again = load_annotations(tmp_path / "out.jsonl", None).samples
    strip = lambda s: (s.sample_id, s.video, s.duration, s.query, s.span, s.clip_start, s.clip_end)  # noqa: E731
    assert [strip(s) for s in again] == [strip(s) for s in original]

    clamped = load_annotations(FIX / "activitynet_bad.json", tmp_path, strict=False).samples
    write_jsonl(clamped, tmp_path / "clamped.jsonl")
    assert '"span": [2.0, 20.3]' in (tmp_path / "clamped.jsonl").read_text()  # the file's span, not the clamped one
    again = load_annotations(tmp_path / "clamped.jsonl", None).samples
    assert [(s.span, s.raw_span) for s in again] == [((1.0, 5.0), None), ((2.0, 20.0), (2.0, 20.3))]


TIMELENS = Path(__file__).parent / "fixtures" / "timelens"


def test_timelens_bench_files():
    """TimeLens-Bench's format ({video_id: {duration, spans, queries}}): ids VIDEO#k, `<video_id>.mp4`, a query's
    whitespace squashed as its loader does; the end 0.38 s past 30.12 s is kept, clamped (raw_span the file's)."""
    path = TIMELENS / "charades-timelens.json"
    assert detect_format(path) == "timelens"
    res = load_annotations(path, VIDEOS)
    assert res.skipped == []
    assert [(s.sample_id, s.video, s.duration, s.span, s.raw_span) for s in res.samples] == [
        ("3MSZA#0", "/videos/3MSZA.mp4", 30.96, (24.3, 30.4), None),
        ("3MSZA#1", "/videos/3MSZA.mp4", 30.96, (0.0, 7.2), None),
        ("AO8RW#0", "/videos/AO8RW.mp4", 12.5, (2.5, 9.1), None),
        ("KWZSA#0", "/videos/KWZSA.mp4", 30.12, (13.4, 30.12), (13.4, 30.5))]
    assert res.samples[1].query == "The person places a book on the shelf."
    assert res.samples[1].where == f"{path}['3MSZA'] query 1 (sample 3MSZA#1)"
    qvh = load_annotations(TIMELENS / "qvhighlights-timelens.json", VIDEOS, fmt="timelens_bench").samples
    assert [(s.sample_id, s.video, s.span) for s in qvh] == [
        ("bP5KfdFJzC4_60.0_210.0#0", "/videos/bP5KfdFJzC4_60.0_210.0.mp4", (12.0, 40.0)),
        ("bP5KfdFJzC4_60.0_210.0#1", "/videos/bP5KfdFJzC4_60.0_210.0.mp4", (96.0, 150.0))]


def test_timelens_bench_bad_records(tmp_path):
    path = tmp_path / "activitynet-timelens.json"
    path.write_text(json.dumps({
        "v_a": {"duration": 60.0, "spans": [[[1.0, 5.0]], [4.0]], "queries": ["one span as [[s, e]]", "half"],
                "split": "test"},
        "v_b": {"duration": 60.0, "spans": [[1.0, 2.0]], "queries": []}}))
    res = load_annotations(path, None, strict=False)
    assert [(s.sample_id, s.span, s.meta) for s in res.samples] == [("v_a#0", (1.0, 5.0), {"split": "test"})]
    assert [(w.split(".json", 1)[1], r) for w, r in res.skipped] == [
        ("['v_a'] query 1", "span is [4.0], expected [start, end]"),
        ("['v_b']", "needs lists 'spans' and 'queries' of equal length")]
