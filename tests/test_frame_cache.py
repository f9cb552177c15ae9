"""The decoded-frame cache (`data.frame_cache`) and `mmpg prepare-videos`: a second pass decodes no video and gets the
very frames; a damaged entry, a changed file or a changed setting decodes again; concurrent writers leave one good
entry; the cap evicts the least recently used entry; prepare-videos fills the cache training reads. Videos are tiny
real mp4 files (64x48, 8 fps, 2-3 s) written here."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import struct

import numpy as np
import pytest
import torch

from batches import write_mp4
from mmpg.data import dataset as dataset_mod
from mmpg.data.dataset import GroundingDataset, collate_grounding
from mmpg.data.frame_cache import MAGIC, FrameCache, cache_key
from mmpg.data.samples import GroundingSample
from mmpg.data.video import DecodedVideo, VideoSpec, load_video

SPEC = VideoSpec(min_pixels=4 * 28 * 28, max_pixels=8 * 28 * 28)  # 4..8 tokens per frame: fast, no upscaling
GB = 10 ** 9


def _mp4(path, seconds, fps=8, seed=0):
    rng = np.random.default_rng(seed)
    n = int(seconds * fps)
    frames = []
    for i in range(n):
        img = np.zeros((48, 64, 3), np.uint8)
        img[:, : (i * 64) // n] = 200
        frames.append(img + rng.integers(0, 40, img.shape, dtype=np.uint8))
    return str(write_mp4(path, frames, fps))


@pytest.fixture(scope="module")
def vids(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return {"a": _mp4(d / "a.mp4", 3.0), "b": _mp4(d / "b.mp4", 2.0, seed=1), "dir": d}


def _sample(video, q=0, clip=(None, None)):
    return GroundingSample(f"{os.path.basename(video)}#{q}", video, None, f"query {q}", (0.5, 1.0),
                           clip_start=clip[0], clip_end=clip[1])


@pytest.fixture
def decodes(monkeypatch):
    """Counts the dataset's calls of the real decoder."""
    calls = []

    def counted(path, spec, clip_start=None, clip_end=None):
        calls.append(path)
        return load_video(path, spec, clip_start, clip_end)

    monkeypatch.setattr(dataset_mod, "load_video", counted)
    return calls


def _same(x: DecodedVideo, y: DecodedVideo):
    assert x.frames.dtype == y.frames.dtype == torch.float32
    assert torch.equal(x.frames, y.frames)
    assert (x.timestamps, x.sample_fps, x.metadata, x.path, x.duration) == \
        (y.timestamps, y.sample_fps, y.metadata, y.path, y.duration)


def test_a_second_pass_decodes_nothing_and_gets_the_same_frames_bit_for_bit(vids, tmp_path, decodes):
    past_the_end = dataclasses.replace(_sample(vids["a"], 9), span=(5.0, 6.0))  # a is 3 s long: a skip
    samples = [past_the_end, _sample(vids["a"], 0), _sample(vids["b"], 0), _sample(vids["a"], 1),
               _sample(vids["b"], 1, (0.5, 1.5))]
    ds = GroundingDataset(samples, SPEC, cache=FrameCache(tmp_path / "cache", GB))
    first = collate_grounding(ds.__getitems__([0, 1, 2, 3, 4]))
    assert first.decode_stats == {"decoded": 3, "cached": 0} and len(decodes) == 3  # a, b, b's clip
    assert len(first.skipped) == 1
    second = collate_grounding(ds.__getitems__([0, 1, 2, 3, 4]))
    assert second.decode_stats == {"decoded": 0, "cached": 3} and len(decodes) == 3  # no file read again
    assert second.videos[0] is second.videos[2]  # a's queries still share one object
    plain = collate_grounding(GroundingDataset(samples, SPEC).__getitems__([0, 1, 2, 3, 4]))
    assert plain.decode_stats == {"decoded": 3, "cached": 0}
    for cached, decoded in zip(second.videos, plain.videos):
        _same(cached, decoded)
    assert [s.duration for s in second.samples] == [s.duration for s in plain.samples]


def test_epoch_two_of_the_training_stream_and_the_held_out_eval_read_the_cache(vids, tmp_path, decodes):
    from mmpg.config import load_config
    from mmpg.eval.batches import _Indexed
    from mmpg.train.data import make_train_loader
    from mmpg.train.heldout import heldout_settings
    from mmpg.train.setup import frame_cache

    cfg = load_config(None, [f"data.frame_cache={tmp_path / 'frames'}", "data.frame_cache_gb=0.5"])
    cache = frame_cache(cfg)
    assert (cache.root, cache.max_bytes) == (tmp_path / "frames", 5 * 10 ** 8)
    samples = [_sample(vids["a"], 0), _sample(vids["b"], 0), _sample(vids["a"], 1)]
    loader = make_train_loader(samples, SPEC, None, None, global_batch=3, rank=0, world=1, seed=0, shuffle=True,
                               start=0, num_workers=0, frame_cache=cache)
    batches = iter(loader)
    assert [next(batches).decode_stats for _ in range(2)] == [{"decoded": 2, "cached": 0}, {"decoded": 0, "cached": 2}]
    assert loader.decode(samples[:2]).decode_stats == {"decoded": 0, "cached": 2}  # a rank's slice dealt again
    settings = heldout_settings(cfg)  # evaluation during training reads the same cache
    assert (settings.frame_cache, settings.frame_cache_gb) == (str(tmp_path / "frames"), 0.5)
    items = _Indexed(samples, [0, 1], SPEC, cache).__getitems__([0, 1])
    assert [it.source for _, it in items] == ["cached", "cached"] and len(decodes) == 2


def _entry(cache, path, spec=SPEC):
    return cache.entry_path(cache_key(path, spec, None, None))


def _rewrite_header(file, change):
    data = file.read_bytes()
    n = struct.unpack("<I", data[8:12])[0]
    header = json.loads(data[12:12 + n])
    change(header)
    head = json.dumps(header).encode()
    file.write_bytes(MAGIC + struct.pack("<I", len(head)) + head + data[12 + n:])


DAMAGE = {
    "truncated": lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
    "flipped byte": lambda f: f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1])),
    "bad header": lambda f: f.write_bytes(MAGIC + b"\xff\xff\x00\x00{not json" + f.read_bytes()[40:]),
    "wrong shape": lambda f: _rewrite_header(f, lambda h: h.update(shape=[h["shape"][0] // 2] + h["shape"][1:])),
    "empty": lambda f: f.write_bytes(b""),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_never_trusted_but_decoded_again(vids, tmp_path, damage, caplog):
    cache = FrameCache(tmp_path, GB)
    calls = []

    def decode(*args):
        calls.append(args[0])
        return load_video(*args)

    fresh, hit = cache.load(vids["a"], SPEC, decode=decode)
    assert not hit and len(calls) == 1
    DAMAGE[damage](_entry(cache, vids["a"]))
    with caplog.at_level(logging.INFO, logger="mmpg.data"):
        again, hit = cache.load(vids["a"], SPEC, decode=decode)
    assert not hit and len(calls) == 2  # decoded from the file, not read from the damaged entry
    _same(again, fresh)
    assert "not a good entry" in caplog.text and "decoding" in caplog.text
    _same(cache.load(vids["a"], SPEC, decode=decode)[0], fresh)  # and stored whole again
    assert len(calls) == 2


def test_a_changed_file_or_setting_decodes_again(vids, tmp_path, decodes):
    import shutil

    path = str(tmp_path / "v.mp4")
    shutil.copy(vids["a"], path)
    cache = FrameCache(tmp_path / "cache", GB)
    run = lambda spec=SPEC, clip=(None, None): collate_grounding(  # noqa: E731
        GroundingDataset([_sample(path, 0, clip)], spec, cache=cache).__getitems__([0])).decode_stats
    assert run() == {"decoded": 1, "cached": 0} and run() == {"decoded": 0, "cached": 1}
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # the file touched: maybe another video now
    assert run() == {"decoded": 1, "cached": 0} and run() == {"decoded": 0, "cached": 1}
    fewer = VideoSpec(**{**SPEC.__dict__, "max_frames": 4})  # data.max_frames changed
    assert run(fewer) == {"decoded": 1, "cached": 0} and run(fewer) == {"decoded": 0, "cached": 1}
    assert run(clip=(0.5, 2.0)) == {"decoded": 1, "cached": 0}  # another clip window
    assert run() == {"decoded": 0, "cached": 1} and len(decodes) == 4  # the first settings' entry is still good


def test_a_sequence_parallel_rank_caches_and_reads_only_its_part(vids, tmp_path, monkeypatch):
    """Under sp = 2 each rank decodes its part once, reads it back bit for bit the next epoch, and a whole entry
    (what `mmpg prepare-videos` stores) serves both ranks with no decode; a rank with no frame of a short clip keeps
    an empty part."""
    from mmpg.data.video import VideoPart, load_video_part

    parts = []

    def counted(path, spec, clip_start=None, clip_end=None, *, rank, sp):
        parts.append((path, rank, sp))
        return load_video_part(path, spec, clip_start, clip_end, rank=rank, sp=sp)

    monkeypatch.setattr(dataset_mod, "load_video_part", counted)
    whole = load_video(vids["a"], SPEC)
    short = (0.5, 1.0)  # 4 frames at most: 2 temporal patches, and over 4 ranks two hold none
    samples = [_sample(vids["a"], 0), _sample(vids["a"], 1), _sample(vids["b"], 0, short)]
    for sp in (2, 4):
        cache = FrameCache(tmp_path / f"cache{sp}", GB)
        for epoch in range(2):
            got = []
            for rank in range(sp):
                batch = collate_grounding(GroundingDataset(samples, SPEC, cache=cache, part=(rank, sp))
                                          .__getitems__([0, 1, 2]))
                want = {"decoded": 2, "cached": 0} if epoch == 0 else {"decoded": 0, "cached": 2}
                assert batch.decode_stats == want, (sp, epoch, rank)
                assert all(isinstance(v, VideoPart) and (v.rank, v.sp) == (rank, sp) for v in batch.videos)
                assert batch.videos[0] is batch.videos[1]  # a's two queries: one part
                got.append(batch.videos[0].frames)
                assert batch.decoded_frames == (0 if epoch else sum(int(batch.videos[i].frames.shape[0])
                                                                    for i in (0, 2)))
                if sp == 4 and rank in (0, 2):
                    assert batch.videos[2].frames.shape[0] == 0  # nothing of the short clip's 2 patches here
            assert torch.equal(torch.cat(got), whole.frames)  # the parts, cached or not, are the whole decode's
        assert len(parts) == 2 * sp  # each rank decoded each video once, in the first epoch only
        parts.clear()
    # a whole entry serves the ranks: no decode, each cuts its part from it
    cache = FrameCache(tmp_path / "whole", GB)
    assert cache.load(vids["a"], SPEC)[1] is False
    for rank in range(2):
        batch = collate_grounding(GroundingDataset(samples[:1], SPEC, cache=cache, part=(rank, 2)).__getitems__([0]))
        assert batch.decode_stats == {"decoded": 0, "cached": 1}
        assert torch.equal(batch.videos[0].frames, whole.part(rank, 2).frames)
    assert parts == []


def _writer(root, key, video, barrier, rounds, bad):
    cache = FrameCache(root, GB)
    barrier.wait()
    for _ in range(rounds):
        cache.put(key, video)
        if cache.get(key, video.path) is None:  # a half-written entry seen (and deleted)
            bad.value += 1


def test_two_processes_filling_one_entry_leave_one_good_entry(tmp_path):
    frames = torch.randint(0, 256, (8, 3, 224, 224), generator=torch.Generator().manual_seed(0)).float()
    video = DecodedVideo(frames, [i / 2 for i in range(8)], 2.0, {"fps": 8.0, "frames_indices": list(range(8))},
                         "v.mp4", 4.0)
    key = "ab" + "0" * 62
    ctx = multiprocessing.get_context("fork")
    barrier, bad = ctx.Barrier(2), ctx.Value("i", 0)
    procs = [ctx.Process(target=_writer, args=(tmp_path, key, video, barrier, 15, bad)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert bad.value == 0
    assert sorted(os.listdir(tmp_path / "ab")) == [f"{key}.frames"]  # one entry, no temp file left
    got = FrameCache(tmp_path, GB).get(key, "v.mp4")
    _same(got, video)


def test_the_cap_evicts_the_least_recently_used_entry(vids, tmp_path):
    cache = FrameCache(tmp_path, GB)
    entries = {}
    for name, path in (("a", vids["a"]), ("b", vids["b"])):
        cache.load(path, SPEC)
        entries[name] = _entry(cache, path)
    old = entries["a"].stat().st_mtime - 100
    os.utime(entries["a"], (old, old))  # a written first ...
    os.utime(entries["b"], (old + 10, old + 10))
    assert cache.load(vids["a"], SPEC)[1]  # ... but read last: b is now the least recently used
    import shutil

    c = shutil.copy(vids["b"], tmp_path / "c.mp4")  # a third entry of b's size
    cache.max_bytes = entries["a"].stat().st_size + entries["b"].stat().st_size + 100  # room for two, not three
    cache.load(str(c), SPEC)
    third = _entry(cache, str(c))
    assert entries["a"].exists() and third.exists() and not entries["b"].exists()
    assert cache.size() == (entries["a"].stat().st_size + third.stat().st_size, 2)


# --- mmpg prepare-videos ---


def _config(tmp_path, vids, cache: str | None):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    (vids["dir"] / "broken.mp4").write_bytes(b"\x00" * 2048)
    ann = tmp_path / "train.jsonl"
    rows = [("a.mp4", None), ("a.mp4", None), ("b.mp4", None), ("b.mp4", [0.0, 1.5]), ("broken.mp4", None)]
    ann.write_text("".join(json.dumps({"id": f"s{i}", "video": v, "duration": 2.0, "query": "q", "span": [0.5, 1.0],
                                       **({"clip": c} if c else {})}) + "\n" for i, (v, c) in enumerate(rows)))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"model:\n  path: {model}\ndata:\n  train: {ann}\n  videos: {vids['dir']}\n  format: jsonl\n"
                   f"  min_pixels: {SPEC.min_pixels}\n  max_pixels: {SPEC.max_pixels}\n" +
                   (f"  frame_cache: {cache}\n" if cache else ""))
    return str(cfg)


def test_prepare_videos_fills_the_cache_training_reads(vids, tmp_path, capsys, decodes):
    from mmpg.cli import main
    from mmpg.config import load_config
    from mmpg.train.setup import frame_cache, load_train_samples, video_spec

    config = _config(tmp_path, vids, str(tmp_path / "frames"))
    assert main(["prepare-videos", "--config", config, "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 videos: 3 decoded, 0 already cached, 1 failed" in out and "broken.mp4" in out
    assert main(["prepare-videos", "--config", config, "--workers", "1"]) == 0
    assert "4 videos: 0 decoded, 3 already cached, 1 failed" in capsys.readouterr().out
    cfg = load_config(config)
    samples = load_train_samples(cfg)
    ds = GroundingDataset(samples, video_spec(cfg, "qwen2_5_vl"), cache=frame_cache(cfg))
    batch = collate_grounding(ds.__getitems__(list(range(len(samples)))))
    assert batch.decode_stats == {"decoded": 0, "cached": 3} and len(batch.skipped) == 1  # the keys training uses
    assert [os.path.basename(p) for p in decodes] == ["broken.mp4"]  # a video that fails is never cached


def test_prepare_videos_refuses_without_a_cache_folder(vids, tmp_path, capsys):
    from mmpg.cli import main

    assert main(["prepare-videos", "--config", _config(tmp_path, vids, None)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.frame_cache is not set" in err


def test_a_cache_folder_that_cannot_be_written_is_one_line(tmp_path):
    """Before: a warning for every video and prepare-videos reporting success with nothing stored."""
    from mmpg.data.frame_cache import open_frame_cache
    from mmpg.errors import UserError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError) as err:
        open_frame_cache(str(blocker / "frames"), 1)
    assert str(err.value).startswith(f"data.frame_cache={blocker / 'frames'}: cannot write there")
    assert "\n" not in str(err.value)
    assert open_frame_cache("", 1) is None and open_frame_cache(str(tmp_path / "ok"), 1) is not None


def test_the_zoom_tool_reads_its_clips_through_the_cache(vids, tmp_path, monkeypatch):
    """data.frame_cache with data.template=zoom (`mmpg sft` on trajectories, `mmpg train`): the tool's clip comes
    back as a clip (the cache's (frames, hit) pair unpacked), decoded once and then read from the cache bit for bit."""
    from mmpg.config import Config
    from mmpg.rollout.zoom import ToolTurn, call_text
    from mmpg.train.setup import frame_cache, zoom_environment

    cfg = Config()
    cfg.data.frame_cache = str(tmp_path / "frames")
    cfg.data.min_pixels, cfg.data.max_pixels = SPEC.min_pixels, SPEC.max_pixels
    cfg.zoom.fps, cfg.zoom.max_frames = 4.0, 8
    hits, load = [], FrameCache.load

    def recorded(self, *args, **kwargs):
        out = load(self, *args, **kwargs)
        hits.append(out[1])
        return out

    monkeypatch.setattr(FrameCache, "load", recorded)
    env = zoom_environment(cfg, "qwen2_5_vl", frame_cache(cfg))
    sample = dataclasses.replace(_sample(vids["a"]), duration=3.0)
    turn = f"<think>look</think>{call_text(0.5, 2.0)}"
    first, second = env.step(sample, turn, 0), env.step(sample, turn, 0)
    assert isinstance(first, ToolTurn) and first.window == (0.5, 2.0) and first.frames == first.clip.frames.shape[0] > 0
    assert hits == [False, True]  # decoded, then read back
    _same(second.clip, first.clip)
    _same(first.clip, load_video(vids["a"], env.spec, 0.5, 2.0))
