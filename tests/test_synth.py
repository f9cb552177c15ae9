"""Tests for mmpg.toy.videos and mmpg.toy.scenes: decodable files, spans visible exactly where annotated, determinism,
splits, and bad input that leaves nothing behind.

Settings are tiny (128x96, 8 fps, 4-8 s) so the whole file runs in seconds on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")  # read once, when qwen_vl_utils is imported

import decord  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mmpg.errors import UserError  # noqa: E402
from mmpg.toy import render, scenes, videos  # noqa: E402

SMALL = dict(min_duration=4.0, max_duration=8.0, sizes=((128, 96),), fps_choices=(8.0,))
N = 6
TOLERANCE = 40  # per channel, allows for H.264 + 4:2:0 colour error
MARGIN_S = 0.5  # frames this close to a span edge are not checked either way
MAX_STRAY = 5  # "essentially none" outside a span


def _load(root: Path, name: str) -> dict:
    return json.loads((root / f"{name}.json").read_text())


def _all_annotations(root: Path) -> dict:
    return {**_load(root, "train"), **_load(root, "val"), **_load(root, "test")}


def _decode(root: Path, video_id: str) -> np.ndarray:
    """All frames of one video, [T, H, W, 3] int16 RGB."""
    reader = decord.VideoReader(str(root / "videos" / f"{video_id}.mp4"))
    return reader.get_batch(list(range(len(reader)))).asnumpy().astype(np.int16)


def _count_near(frame: np.ndarray, rgb) -> int:
    """Pixels of frame [H, W, 3] within TOLERANCE of rgb in every channel."""
    return int((np.abs(frame - np.asarray(rgb)).max(axis=-1) <= TOLERANCE).sum())


def span_problems(frames: np.ndarray, fps: float, event: dict, span) -> list[str]:
    """Check one event against an annotated span [s, e]; returns what is wrong (empty when fine).

    Inside (at least MARGIN_S from both edges) the expected colour must cover a quarter of the
    object's bounding square (a triangle covers half of it); for "changes_colour" the expected
    colour switches at the span midpoint, frames within 1.5 frames of it are skipped. Outside
    (more than MARGIN_S away) neither of the event's colours may show.
    """
    start, end = span
    mid = (start + end) / 2
    colours = [event["rgb"]] + ([event["to_rgb"]] if event["to_rgb"] else [])
    min_pixels = 0.25 * event["size"] ** 2
    problems = []
    for i, frame in enumerate(frames):
        t = i / fps
        if start + MARGIN_S <= t <= end - MARGIN_S:
            if event["to_rgb"] and abs(t - mid) < 1.5 / fps:
                continue
            rgb = event["to_rgb"] if event["to_rgb"] and t >= mid else event["rgb"]
            if (got := _count_near(frame, rgb)) < min_pixels:
                problems.append(f"{event['sentence']!r} t={t:.3f}: {got} pixels of {rgb} inside {span}")
        elif t < start - MARGIN_S or t > end + MARGIN_S:
            if (got := sum(_count_near(frame, c) for c in colours)) > MAX_STRAY:
                problems.append(f"{event['sentence']!r} t={t:.3f}: {got} pixels outside {span}")
    return problems


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synth") / "ds"
    summary = videos.generate_dataset(root, N, seed=0, **SMALL)
    assert summary["n_videos"] == N and summary["out"] == str(root)
    return root


def test_videos_decode_with_decord_and_match_truth(dataset):
    truth = _load(dataset, "events")
    annotations = _all_annotations(dataset)
    assert sorted(p.stem for p in (dataset / "videos").glob("*.mp4")) == sorted(truth)
    for video_id, info in truth.items():
        reader = decord.VideoReader(str(dataset / "videos" / f"{video_id}.mp4"))
        assert len(reader) == info["n_frames"], video_id
        assert reader.get_avg_fps() == pytest.approx(info["fps"]), video_id
        assert reader[0].shape == (info["height"], info["width"], 3), video_id
        frame_s = 1 / info["fps"]
        assert abs(len(reader) / reader.get_avg_fps() - annotations[video_id]["duration"]) <= frame_s, video_id
        assert 4.0 - frame_s <= info["duration"] <= 8.0 + frame_s


def test_videos_load_with_qwen_vl_utils(dataset, monkeypatch):
    from qwen_vl_utils import vision_process

    # Another test may have imported qwen_vl_utils first; force decord and forbid the silent
    # torchvision fallback so a decord failure shows up here.
    monkeypatch.setattr(vision_process, "FORCE_QWENVL_VIDEO_READER", "decord")
    vision_process.get_video_reader_backend.cache_clear()
    monkeypatch.setitem(vision_process.VIDEO_READER_BACKENDS, "torchvision", _no_fallback)
    try:
        video_id, info = next(iter(_load(dataset, "events").items()))
        ele = {"type": "video", "video": str(dataset / "videos" / f"{video_id}.mp4"), "fps": 2.0,
               "min_pixels": 32 * 32, "max_pixels": 64 * 64 * 4}
        video, meta = vision_process.fetch_video(ele, return_video_metadata=True)
    finally:
        vision_process.get_video_reader_backend.cache_clear()
    assert video.ndim == 4 and video.shape[1] == 3, video.shape  # [T, C, H', W']
    assert video.shape[0] == len(meta["frames_indices"])
    assert abs(video.shape[0] - 2.0 * info["duration"]) <= 2, (video.shape, info["duration"])
    assert video.shape[2] * video.shape[3] <= 64 * 64 * 4


def _no_fallback(ele):
    raise AssertionError(f"qwen-vl-utils fell back to torchvision for {ele['video']}: decord failed")


def test_events_visible_exactly_within_annotated_spans(dataset):
    truth, annotations = _load(dataset, "events"), _all_annotations(dataset)
    problems, checked = [], 0
    for video_id, info in truth.items():
        frames = _decode(dataset, video_id)
        spans = annotations[video_id]["timestamps"]
        assert spans == [[e["start"], e["end"]] for e in info["events"]], video_id
        for event, span in zip(info["events"], spans):
            problems += [f"{video_id}: {p}" for p in span_problems(frames, info["fps"], event, span)]
            checked += 1
    assert checked >= N and not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:20])


def test_moving_objects_follow_their_path(dataset):
    """The colour's centroid at 25% and 75% of the span is where centre_start -> centre_end puts it."""
    checked = 0
    for video_id, info in _load(dataset, "events").items():
        frames = _decode(dataset, video_id)
        for e in (e for e in info["events"] if e["centre_start"] != e["centre_end"]):
            for p in (0.25, 0.75):
                i = int(np.ceil((e["start"] + p * (e["end"] - e["start"])) * info["fps"]))
                p_frame = (i / info["fps"] - e["start"]) / (e["end"] - e["start"])
                want = np.add(e["centre_start"], p_frame * np.subtract(e["centre_end"], e["centre_start"]))
                ys, xs = np.nonzero(np.abs(frames[i] - np.asarray(e["rgb"])).max(axis=-1) <= TOLERANCE)
                got = (xs.mean() + 0.5, ys.mean() + 0.5)
                # a triangle's centroid sits size/6 below its bounding-square centre
                if e["shape"] == "triangle":
                    want = want + (0.0, e["size"] / 6)
                assert np.abs(np.subtract(got, want)).max() <= 2.0, (video_id, e["sentence"], p, got, want)
                checked += 1
    assert checked, "no moving event in the fixture dataset; change its seed or N"


def test_span_check_catches_spans_shifted_by_two_seconds(dataset):
    """The visibility check must fail for every event if the annotation were 2 s late."""
    truth = _load(dataset, "events")
    for video_id, info in truth.items():
        frames = _decode(dataset, video_id)
        for event in info["events"]:
            shifted = [event["start"] + 2.0, event["end"] + 2.0]
            assert span_problems(frames, info["fps"], event, shifted), (video_id, event["sentence"])


def test_events_are_distinct_and_well_formed(dataset):
    for video_id, info in _load(dataset, "events").items():
        events = info["events"]
        assert 1 <= len(events) <= scenes.MAX_EVENTS, video_id
        colours = [e["colour"] for e in events] + [e["to_colour"] for e in events if e["to_colour"]]
        assert len(set(colours)) == len(colours), (video_id, colours)
        for e in events:
            assert e["end"] - e["start"] >= scenes.MIN_SPAN_S - 1e-9, (video_id, e)
            assert 0 <= e["start"] and e["end"] <= info["duration"], (video_id, e)
            assert e["motion"] in scenes.MOTIONS and e["shape"] in render.SHAPES
            assert tuple(e["rgb"]) == render.PALETTE[e["colour"]]


def test_same_seed_gives_identical_bytes_and_another_seed_differs(dataset, tmp_path):
    again = tmp_path / "again"
    videos.generate_dataset(again, N, seed=0, **SMALL)
    files = sorted(p.relative_to(dataset) for p in dataset.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (dataset / rel).read_bytes() == (again / rel).read_bytes(), f"{rel} differs between runs"

    other = tmp_path / "other"
    videos.generate_dataset(other, 2, seed=1, **SMALL)
    assert (other / "events.json").read_bytes() != (dataset / "events.json").read_bytes()
    assert (other / "videos/synth_00000.mp4").read_bytes() != (dataset / "videos/synth_00000.mp4").read_bytes()


def test_splits_partition_the_videos(dataset):
    splits = {name: _load(dataset, name) for name in videos.SPLIT_NAMES}
    ids = [vid for split in splits.values() for vid in split]
    assert len(ids) == len(set(ids)) == N
    assert set(ids) == set(_load(dataset, "events"))
    assert all(splits.values()), {k: len(v) for k, v in splits.items()}
    for split in splits.values():
        for video_id, ann in split.items():
            assert set(ann) == {"duration", "timestamps", "sentences"}, video_id
            assert isinstance(ann["duration"], float) and len(ann["timestamps"]) == len(ann["sentences"])
            assert all(len(span) == 2 and span[0] < span[1] for span in ann["timestamps"])
            assert all(isinstance(s, str) and s.startswith("a") for s in ann["sentences"])


@pytest.mark.parametrize("n, expected", [(1, (1, 0, 0)), (2, (2, 0, 0)), (3, (1, 1, 1)), (10, (6, 2, 2))])
def test_split_sizes(n, expected):
    ids = [f"v{i}" for i in range(n)]
    got = videos.split_ids(ids, (0.7, 0.15, 0.15), np.random.default_rng(0))
    assert tuple(len(got[name]) for name in videos.SPLIT_NAMES) == expected
    assert sorted(sum(got.values(), [])) == sorted(ids)


def test_small_n_writes_empty_val_and_test(tmp_path):
    videos.generate_dataset(tmp_path / "one", 1, **SMALL)
    assert len(_load(tmp_path / "one", "train")) == 1
    assert _load(tmp_path / "one", "val") == {} and _load(tmp_path / "one", "test") == {}


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n=0"),
    (dict(n=-2), "n=-2"),
    (dict(seed=-1), "seed=-1"),
    (dict(min_duration=0.0), "min_duration=0.0"),
    (dict(min_duration=-3.0), "min_duration=-3.0"),
    (dict(min_duration=9.0, max_duration=5.0), "larger than max_duration"),
    (dict(max_duration=float("inf")), "not a finite"),
    (dict(sizes=((127, 96),)), "even"),
    (dict(fps_choices=(0.0,)), "fps_choices"),
    (dict(splits=(0.5, 0.2, 0.2)), "summing to 1"),
])
def test_bad_arguments_raise_user_error_and_write_nothing(tmp_path, kwargs, message):
    args = dict(n=2, seed=0, **SMALL) | kwargs
    with pytest.raises(UserError, match=message) as info:
        videos.generate_dataset(tmp_path / "out", **args)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_non_empty_out_needs_overwrite_and_overwrite_replaces(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(UserError, match="is not empty; pass --overwrite or choose another folder"):
        videos.generate_dataset(out, 2, **SMALL)
    assert (out / "keep.txt").read_text() == "user data"

    videos.generate_dataset(out, 2, overwrite=True, **SMALL)
    assert not (out / "keep.txt").exists()
    assert len(list((out / "videos").glob("*.mp4"))) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old folder left


def test_out_that_is_a_file_or_the_current_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        videos.generate_dataset(tmp_path / "file", 1, **SMALL)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="refusing to overwrite"):
        videos.generate_dataset(tmp_path, 1, overwrite=True, **SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_empty_existing_out_is_filled_in_place(tmp_path, monkeypatch):
    """An empty `out` may be the caller's current folder: it is filled, not replaced."""
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path / "out")
    videos.generate_dataset(".", 1, **SMALL)
    assert Path.cwd() == (tmp_path / "out").resolve()  # still exists: the folder itself was kept
    assert sorted(p.name for p in Path.cwd().iterdir()) == sorted(
        ["events.json", "test.json", "train.json", "val.json", "videos"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("existing", [False, True])
def test_failure_midway_leaves_no_partial_output(tmp_path, monkeypatch, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "keep.txt").write_text("old dataset")
    calls = []

    def encode_then_fail(path, frames, *args):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real_encode(path, frames, *args)

    real_encode = render.encode_video
    monkeypatch.setattr(render, "encode_video", encode_then_fail)
    with pytest.raises(OSError, match="simulated"):
        videos.generate_dataset(out, 3, overwrite=True, **SMALL)
    assert len(calls) == 2
    if existing:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_easy_videos_show_one_white_shape_exactly_within_whole_second_spans(tmp_path):
    """The learning demo's task: one large white shape on black, 64x64 at 2 fps, whole-second spans."""
    videos.generate_dataset(tmp_path / "easy", 6, 3, min_duration=8, max_duration=20, easy=True)
    truth = _load(tmp_path / "easy", "events")
    for video_id, video in truth.items():
        assert (video["width"], video["height"], video["fps"]) == (64, 64, 2.0)
        assert video["duration"] == int(video["duration"]) and 8 <= video["duration"] <= 20
        (event,) = video["events"]
        start, end = event["start"], event["end"]
        assert start == int(start) and end == int(end) and 2 <= end - start <= max(2, int(0.6 * video["duration"]))
        assert event["sentence"] in ("a white circle appears", "a white square appears")
        frames = _decode(tmp_path / "easy", video_id)  # [T, H, W, 3]
        assert frames.shape[0] == video["n_frames"]
        for i, frame in enumerate(frames):
            centre = frame[28:36, 28:36].astype(int).mean()
            corner = frame[:4, :4].astype(int).mean()
            inside = start <= i / video["fps"] < end
            assert corner < 30, (video_id, i)
            assert (centre > 200) == inside, (video_id, i, centre, inside)


def test_easy_videos_with_several_wordings_of_their_moment(tmp_path):
    """--queries 3: each easy video asked about in 2-3 distinct wordings of its one span; the videos themselves are
    the ones queries=1 draws (the wordings are drawn last), and the annotations load as several queries a video."""
    from mmpg.data.formats import load_annotations

    videos.generate_dataset(tmp_path / "one", 8, 5, min_duration=8, max_duration=20, easy=True)
    videos.generate_dataset(tmp_path / "three", 8, 5, min_duration=8, max_duration=20, easy=True, queries=3)
    one, three = _load(tmp_path / "one", "events"), _load(tmp_path / "three", "events")
    assert one == three  # same videos, same events
    counts = []
    for split in ("train", "val", "test"):
        annotations = _load(tmp_path / "three", split)
        for video_id, entry in annotations.items():
            shape = three[video_id]["events"][0]["shape"]
            (span,) = {tuple(t) for t in entry["timestamps"]}
            assert span == (three[video_id]["events"][0]["start"], three[video_id]["events"][0]["end"])
            assert 2 <= len(entry["sentences"]) <= 3 and len(set(entry["sentences"])) == len(entry["sentences"])
            assert all(shape in s for s in entry["sentences"])
            counts.append(len(entry["sentences"]))
        if annotations:
            loaded = load_annotations(tmp_path / "three" / f"{split}.json", tmp_path / "three" / "videos",
                                      strict=True).samples
            assert len(loaded) == sum(len(e["sentences"]) for e in annotations.values())
    assert sum(counts) > len(counts)
    with pytest.raises(UserError, match="--easy videos only"):
        videos.generate_dataset(tmp_path / "hard", 2, 0, min_duration=8, max_duration=20, queries=3)
