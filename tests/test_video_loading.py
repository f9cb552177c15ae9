"""Video decoding through qwen-vl-utils, the dataset / collate skip path, fill_durations, check-data, and the
end-to-end step to processor inputs. Videos are tiny real mp4 files written here with PyAV (64x48, 8 fps, 3 s)."""

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from batches import write_mp4
from mmpg.data.check import check_dataset, format_report, run_check
from mmpg.data.dataset import GroundingCollator, GroundingDataset, collate_grounding, make_dataloader
from mmpg.data.formats import fill_durations, load_annotations
from mmpg.data.prompts import PromptTemplate, build_messages, build_prompt_inputs
from mmpg.data.samples import GroundingSample
from mmpg.data.video import VideoError, VideoSpec, load_video, read_duration, verify_video
from mmpg.errors import UserError

FPS, SECONDS, W, H = 8, 3.0, 64, 48
SMALL = dict(min_pixels=4 * 28 * 28, max_pixels=8 * 28 * 28)  # 4..8 tokens per frame: fast and no upscaling


def make_mp4(path: Path, seconds: float = SECONDS, fps: int = FPS) -> Path:
    """A real H.264 mp4: a white bar that grows left to right, with a little fixed noise."""
    n = int(round(seconds * fps))
    rng = np.random.default_rng(0)

    def frame(i):
        img = np.zeros((H, W, 3), np.uint8)
        img[:, : (i * W) // n] = 200
        return img + rng.integers(0, 40, img.shape, dtype=np.uint8)

    return write_mp4(path, (frame(i) for i in range(n)), fps)


@pytest.fixture(scope="module")
def vids(tmp_path_factory) -> Path:
    """good.mp4 (3 s), other.mkv-less id `other` as .mp4 (2 s), and the bad ones."""
    d = tmp_path_factory.mktemp("videos")
    good = make_mp4(d / "good.mp4")
    make_mp4(d / "other.mp4", seconds=2.0)
    data = good.read_bytes()
    (d / "truncated.mp4").write_bytes(data[: len(data) // 2])  # moov atom (at the end) lost: cannot open
    zeroed = bytearray(data)
    zeroed[len(data) // 4: 3 * len(data) // 4] = bytes(len(data) // 2)  # header fine, frames destroyed
    (d / "corrupt.mp4").write_bytes(bytes(zeroed))
    (d / "empty.mp4").write_bytes(b"")  # zero-length file
    return d


def sample(vids, name="good", span=(0.5, 1.5), duration=SECONDS, **kw) -> GroundingSample:
    return GroundingSample(f"{name}#0", str(vids / f"{name}.mp4"), duration, "the bar grows", span,
                           origin=f"ann.jsonl:{kw.pop('line', 1)}", **kw)


# --- load_video ---

def test_load_video_frames_and_timestamps(vids):
    v = load_video(str(vids / "good.mp4"), VideoSpec(**SMALL))
    # 24 frames at 8 fps, sampled at 2 fps -> 24/8*2 = 6 frames at linspace(0, 23, 6) = 0, 4.6, 9.2, 13.8, 18.4, 23
    assert v.metadata["frames_indices"] == [0, 5, 9, 14, 18, 23]
    assert v.timestamps == pytest.approx([0.0, 0.625, 1.125, 1.75, 2.25, 2.875])  # index / 8
    assert v.sample_fps == pytest.approx(2.0)  # 6 frames / (24 / 8 s)
    assert v.duration == pytest.approx(3.0)
    t, c, h, w = v.frames.shape
    assert (t, c) == (6, 3) and h % 28 == 0 and w % 28 == 0
    assert 4 * 28 * 28 <= h * w <= 8 * 28 * 28  # min/max pixels respected, no upscaling to 128 tokens
    assert v.frames.dtype == torch.float32
    assert v.frames[-1].mean() > v.frames[0].mean()  # the bar has grown: frames are really in order


def test_load_video_clip_window(vids):
    v = load_video(str(vids / "good.mp4"), VideoSpec(**SMALL), clip_start=1.0, clip_end=2.5)
    # window frames ceil(1.0*8) = 8 .. floor(2.5*8) = 20: 13 frames = 1.625 s -> 1.625*2 = 3.25 -> 4 (min_frames)
    assert v.metadata["frames_indices"] == [8, 12, 16, 20]
    assert v.timestamps == pytest.approx([1.0, 1.5, 2.0, 2.5])  # whole-video seconds, not clip seconds
    assert v.duration == pytest.approx(3.0)


def test_max_frames_and_family_patch(vids):
    v = load_video(str(vids / "good.mp4"), VideoSpec.for_family("qwen3_vl", fps=8.0, max_frames=8,
                                                                min_pixels=4 * 32 * 32, max_pixels=8 * 32 * 32))
    assert v.frames.shape[0] == 8  # 24 frames at 8 fps would be 24; capped
    assert v.frames.shape[2] % 32 == 0 and v.frames.shape[3] % 32 == 0


@pytest.mark.parametrize("name,message", [
    ("missing", "video file not found"),
    ("empty", "video file is empty (0 bytes)"),
    ("truncated", "cannot open video"),
    ("corrupt", "could not decode frames"),
])
def test_bad_videos_raise_video_error(vids, name, message):
    path = str(vids / f"{name}.mp4")
    with pytest.raises(VideoError) as err:
        load_video(path, VideoSpec(**SMALL))
    assert str(err.value).startswith(path + ": ") and message in str(err.value)
    with pytest.raises(VideoError, match=re.escape(message)):
        verify_video(path)  # check-data's probe finds the same


def test_read_duration(vids):
    assert read_duration(str(vids / "other.mp4")) == pytest.approx(2.0)


# --- dataset and collate: never raise on bad data, skip + count + log; strict raises naming the file ---

@pytest.mark.parametrize("kind", ["missing", "empty", "truncated", "corrupt", "span_outside", "start_ge_end"])
def test_dataset_marks_failure_and_collate_drops_it(vids, kind, caplog):
    spec = VideoSpec(**SMALL)
    if kind == "span_outside":  # duration unknown in the annotation, read from the 3 s file
        bad = sample(vids, span=(2.0, 10.0), duration=None, line=7)
    elif kind == "start_ge_end":
        bad = sample(vids, span=(2.0, 2.0), line=7)
    else:
        bad = sample(vids, name=kind, line=7)
    ds = GroundingDataset([sample(vids), bad], spec)
    items = [ds[0], ds[1]]
    assert items[0].ok and not items[1].ok
    with caplog.at_level(logging.WARNING, logger="mmpg.data"):
        batch = collate_grounding(items)
    assert [s.sample_id for s in batch.samples] == ["good#0"] and len(batch.videos) == 1
    assert len(batch.skipped) == 1 and batch.skipped[0].where == f"ann.jsonl:7 (sample {bad.sample_id})"
    assert bad.video in caplog.text and "skipped ann.jsonl:7" in caplog.text

    strict = GroundingDataset([bad], spec, strict=True)
    with pytest.raises(UserError, match=rf"ann.jsonl:7 \(sample {bad.sample_id}\): {bad.video}: .*strict off"):
        strict[0]


def test_dataset_fills_duration_from_file(vids):
    item = GroundingDataset([sample(vids, duration=None, span=(1.0, 3.3))], VideoSpec(**SMALL))[0]
    assert item.ok and item.sample.duration == pytest.approx(3.0)
    assert item.sample.span == pytest.approx((1.0, 3.0))  # 0.3 s past the end: within tolerance, clamped


def test_dataloader_workers_skip_bad_files(vids):
    samples = [sample(vids), sample(vids, "missing"), sample(vids, "corrupt"), sample(vids, "empty"),
               sample(vids, "other", span=(0.0, 1.0), duration=None), sample(vids, "truncated")]
    loader = DataLoader(GroundingDataset(samples, VideoSpec(**SMALL)), batch_size=3, num_workers=1,
                        collate_fn=collate_grounding)
    batches = list(loader)
    assert [[s.sample_id for s in b.samples] for b in batches] == [["good#0"], ["other#0"]]
    assert sum(len(b.skipped) for b in batches) == 4
    assert batches[1].samples[0].duration == pytest.approx(2.0)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_strict_loader_raises_one_line_in_the_main_process(vids, num_workers):
    # raised inside a worker, torch would re-raise it as "Caught UserError in DataLoader worker process 0. Original
    # Traceback ..."; the worker hands the failure back and the loader raises the plain line instead
    bad = sample(vids, "corrupt", line=7)
    samples = [sample(vids), bad, sample(vids, "other", span=(0.0, 1.0), duration=None)]
    loader = make_dataloader(samples, VideoSpec(**SMALL), batch_size=1, num_workers=num_workers, shuffle=False,
                             strict=True)
    batches = iter(loader)
    assert [s.sample_id for s in next(batches).samples] == ["good#0"]
    with pytest.raises(UserError) as err:
        next(batches)
    assert type(err.value) is UserError
    message = str(err.value)
    assert message.startswith(f"ann.jsonl:7 (sample corrupt#0): {bad.video}: could not decode frames")
    assert message.endswith("; fix or remove this sample, or turn strict off to skip it")
    assert "\n" not in message and "Traceback" not in message and "DataLoader worker" not in message

    lenient = make_dataloader(samples, VideoSpec(**SMALL), batch_size=3, num_workers=num_workers, shuffle=False)
    (batch,) = list(lenient)
    assert [s.sample_id for s in batch.samples] == ["good#0", "other#0"]
    assert [skip.where for skip in batch.skipped] == ["ann.jsonl:7 (sample corrupt#0)"]


def test_all_failed_batch_is_empty(vids):
    batch = GroundingCollator(processor=object())([GroundingDataset([sample(vids, "missing")], VideoSpec())[0]])
    assert len(batch) == 0 and batch.inputs is None and len(batch.skipped) == 1


# --- fill_durations ---

def test_fill_durations(vids, tmp_path):
    ann = tmp_path / "ann.txt"
    ann.write_text("good 0.5 2.0##the bar grows.\nother 1.0 9.0##too late.\nmissing 1 2##no file.\n")
    loaded = load_annotations(ann, vids)
    assert all(s.duration is None for s in loaded.samples)
    with pytest.raises(UserError, match=r"ann.txt:2 \(sample other#0\): span 1-9 s is not inside the video"):
        fill_durations(loaded.samples)
    res = fill_durations(loaded.samples, strict=False)
    assert [(s.sample_id, s.duration) for s in res.samples] == [("good#0", pytest.approx(3.0))]
    assert [w.split(" ")[0].rsplit(":", 1)[1] for w, _ in res.skipped] == ["2", "3"]
    assert "video file not found" in res.skipped[1].reason


# --- check-data ---

def test_check_dataset_reports_every_kind(vids, tmp_path, capsys):
    ann = tmp_path / "ann.jsonl"
    ann.write_text("\n".join([
        '{"id": "a", "video": "good", "query": "fine", "span": [0.5, 1.5]}',
        '{"id": "b", "video": "missing", "query": "no file", "span": [0.5, 1.5]}',
        '{"id": "c", "video": "empty", "query": "zero bytes", "span": [0.5, 1.5]}',
        '{"id": "d", "video": "truncated", "query": "cut", "span": [0.5, 1.5]}',
        '{"id": "e", "video": "good", "query": "late", "span": [2.0, 9.0]}',
        '{"id": "f", "video": "good", "query": "backwards", "span": [2.0, 1.0]}',
        '{"id": "a", "video": "other", "query": "same id", "span": [0.5, 1.5]}',
        '{"id": "g", "video": "good", "duration": 60, "query": "wrong duration", "span": [0.5, 1.5]}',
        'not json',
    ]) + "\n")
    report = check_dataset(ann, vids, "auto")
    assert report.fmt == "jsonl" and report.n_samples == 8 and report.n_videos == 5
    assert dict(report.counts()) == {"malformed": 1, "missing_video": 1, "unreadable_video": 2,
                                     "outside_duration": 1, "start_ge_end": 1, "duplicate_id": 1,
                                     "duration_mismatch": 1}
    text = format_report(report)
    assert "ann.jsonl:2 (sample b): " in text and "video file not found" in text
    assert "id 'a' is used 2 times" in text and "8 problems found" in text
    assert run_check(ann, vids, "auto") == 1
    assert "missing videos: 1" in capsys.readouterr().out

    clean = tmp_path / "clean.jsonl"
    clean.write_text('{"id": "a", "video": "good", "query": "fine", "span": [0.5, 1.5]}\n')
    assert run_check(clean, vids, "jsonl") == 0
    assert "OK: no problems found" in capsys.readouterr().out


# --- prompts and processor inputs ---

def test_messages_and_template(vids):
    s = sample(vids, duration=None)
    v = load_video(s.video, VideoSpec(**SMALL))
    msgs = build_messages(s, v)
    assert msgs[0]["role"] == "user" and msgs[0]["content"][0] == {"type": "video", "video": s.video}
    text = msgs[0]["content"][1]["text"]
    assert "lasts 3.00 seconds" in text and '"the bar grows"' in text and "<answer>" in text
    frames = build_messages(s, v, "time_r1_frames")[0]["content"][1]["text"]
    assert "0.00, 0.62, 1.12, 1.75, 2.25, 2.88" in frames  # the sampled timestamps, as listed above
    custom = PromptTemplate("Find {query} in {duration}s.", system="Be brief.", think=False)
    msgs = build_messages(s, v, custom)
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[1]["content"][1]["text"] == "Find the bar grows in 3.00s."
    with pytest.raises(UserError, match=r"unknown placeholder \{video\}"):
        PromptTemplate("{video}")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_processor_inputs_end_to_end(vids, family):
    from mmpg.toy.models import build_tiny_processor
    processor = build_tiny_processor(family)
    f = 28 if family == "qwen2_5_vl" else 32
    spec = VideoSpec.for_family(family, min_pixels=4 * f * f, max_pixels=8 * f * f)
    samples = [sample(vids), sample(vids, "other", span=(0.0, 1.0), duration=None, clip_start=0.5, clip_end=2.0)]
    items = [GroundingDataset(samples, spec)[i] for i in range(2)]
    batch = GroundingCollator(processor)(items)
    inputs = batch.inputs
    b, p = inputs["input_ids"].shape
    assert b == 2 and inputs["attention_mask"].shape == (2, p)
    assert (inputs["attention_mask"][:, -1] == 1).all()  # left padded
    grid = inputs["video_grid_thw"]
    # T/2 temporal patches, H/patch, W/patch. other.mp4 has 16 frames (2 s); clip 0.5-2.0 s -> frames ceil(0.5*8) = 4
    # .. min(floor(2.0*8), 15) = 15: 12 frames = 1.5 s -> 1.5*2 = 3 -> 4 (min_frames) at linspace(4, 15, 4) ->
    # 4, 8, 11, 15 -> 0.5, 1.0, 1.375, 1.875 s; t = 4/2 = 2
    for video, (t, gh, gw) in zip(batch.videos, grid.tolist()):
        assert (t, gh * f // 2, gw * f // 2) == (video.frames.shape[0] // 2, *video.frames.shape[2:])
    assert inputs["pixel_values_videos"].shape[0] == int(grid.prod(-1).sum())
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert (inputs["input_ids"] == video_id).sum() == int(grid.prod(-1).sum()) // 4  # 2x2 merge
    if family == "qwen2_5_vl":
        # seconds per temporal patch = 2 / sample fps: good.mp4 2 / 2.0 = 1.0; the clip 2 / (4 / 1.5 s) = 0.75
        assert inputs["second_per_grid_ts"].tolist() == pytest.approx([1.0, 0.75])
    else:  # Qwen3-VL writes the mean time of each frame pair: (0.5 + 1.0)/2 = 0.75, (1.375 + 1.875)/2 = 1.625
        text = processor.tokenizer.decode(inputs["input_ids"][1])
        assert "<0.8 seconds>" in text and "<1.6 seconds>" in text
    g = 60 - f  # the other family's factor: 32 for 28, 28 for 32
    wrong = load_video(samples[0].video, VideoSpec(image_patch_size=g // 2, min_pixels=4 * g * g, max_pixels=8 * g * g))
    with pytest.raises(UserError, match="not multiples of"):
        build_prompt_inputs(processor, samples[:1], [wrong])


def test_check_dataset_bad_arguments(vids, tmp_path):
    ann = tmp_path / "a.jsonl"
    ann.write_text('{"video": "good", "query": "q", "span": [0, 1]}\n')
    with pytest.raises(UserError, match=r"video folder .*nowhere not found; pass --videos"):
        check_dataset(ann, tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"annotation file .*absent.jsonl not found"):
        check_dataset(tmp_path / "absent.jsonl", vids)


_INHERITED_READER = """
import gc, sys
import decord
from torch.utils.data import Dataset
from mmpg.data.dataset import VideoDataLoader

class Collecting(Dataset):  # each item: how many objects the worker's collector freed
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return gc.collect()

gc.disable()
box = {"reader": decord.VideoReader(sys.argv[1], num_threads=1)}
box["self"] = box  # cyclic garbage holding a reader, as a kept exception's traceback can be
del box
print([int(n) for n in VideoDataLoader(Collecting(), batch_size=1, num_workers=1)])
"""


def test_workers_never_collect_an_inherited_video_reader(vids):
    """A decord reader in garbage inherited by a forked worker and freed there aborts or hangs the worker (CI saw
    "DataLoader worker ... killed by signal: Aborted"); VideoDataLoader forks with the collector frozen, so the
    worker's collector finds nothing of the parent's (0 freed) and the loader finishes."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _INHERITED_READER, str(vids / "good.mp4")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[0, 0]"
