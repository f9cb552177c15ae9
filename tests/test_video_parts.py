"""One sequence-parallel rank's part of a video (`load_video_part`): the frames of the temporal patch groups the rank
encodes, sampled and sized as for the whole video, equal bit for bit to the matching slice of the one-process decode
(`load_video`, qwen-vl-utils' own path), with the whole video's timestamps and metadata. The video is a real H.264
mp4 written here (128x96, 8 fps, 7 s, B-frames, a key frame every 12 frames), sampled to 14 frames: 7 temporal
patch groups, an odd count, so the parts differ in size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpg.data import video as video_mod
from mmpg.data.video import VideoError, VideoPart, VideoSpec, load_video, load_video_part, part_groups
from mmpg.grouping.sequence import frame_ranges

FPS, SECONDS, W, H = 8, 7, 128, 96
# 4..16 tokens a frame, and a video budget that allows 8 per frame for 14 frames: the budget binds, so a part sized by
# its own frame count (instead of the whole video's) would come out larger
SPEC = VideoSpec(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28, total_pixels=8 * 28 * 28 * 14 // 2)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> str:
    """Key frames at 0, 12, 24, 36, 48 and two B-frames between P-frames: a part starts its decode at a key frame
    inside the video, and frames are decoded out of display order."""
    import av

    path = tmp_path_factory.mktemp("parts") / "v.mp4"
    rng = np.random.default_rng(0)
    n = FPS * SECONDS
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={
            "x264-params": "keyint=12:min-keyint=12:scenecut=0:bframes=2:b-adapt=0"})
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(n):
            img = rng.integers(0, 60, (H, W, 3), dtype=np.uint8)
            img[:, : (i * W) // n] += 150  # a bar that grows: every frame differs
            container.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        container.mux(stream.encode())
    return str(path)


def _qwen_vl_utils(path: str, spec, clip_start=None, clip_end=None):
    """The frames and metadata as qwen-vl-utils' own `fetch_video` gives them (the reference `load_video` once
    called; it now decodes through `load_video_part` as rank 0 of 1, which must equal this)."""
    from mmpg.data.video import DecodedVideo, _qwen_vision

    frames, metadata = _qwen_vision.fetch_video(spec.element(path, clip_start, clip_end),
                                                image_patch_size=spec.image_patch_size, return_video_metadata=True)
    from mmpg.data.video import verify_video

    metadata = dict(metadata, frames_indices=[int(i) for i in metadata["frames_indices"]])
    timestamps = [i / metadata["fps"] for i in metadata["frames_indices"]]
    return DecodedVideo(frames=frames, metadata=metadata, timestamps=timestamps, path=str(path),
                        sample_fps=len(timestamps) / (metadata["total_num_frames"] / metadata["fps"]),
                        duration=verify_video(path))


@pytest.fixture(scope="module")
def whole(video):
    return _qwen_vl_utils(video, SPEC)


def test_load_video_is_qwen_vl_utils_own_decode(video, whole):
    got = load_video(video, SPEC)
    assert torch.equal(got.frames, whole.frames) and got.metadata == whole.metadata
    assert (got.timestamps, got.sample_fps, got.path, got.duration) == (whole.timestamps, whole.sample_fps,
                                                                        whole.path, whole.duration)


def _same_whole_facts(part: VideoPart, whole) -> None:
    assert part.timestamps == whole.timestamps and part.metadata == whole.metadata
    assert (part.sample_fps, part.path, part.duration) == (whole.sample_fps, whole.path, whole.duration)
    assert part.whole_frames == whole.frames.shape[0]


def test_the_budget_binds_and_the_groups_are_odd(whole):
    t, _, h, w = whole.frames.shape
    assert t == 14  # 7 s x 2 fps: 7 temporal patch groups
    assert h * w <= SPEC.total_pixels / t * 2 < SPEC.max_pixels


@pytest.mark.parametrize("chunk", [3, video_mod.CHUNK_FRAMES])  # 3: chunks that end inside a temporal group
@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_parts_concatenate_to_the_whole_decode_bit_for_bit(video, whole, sp, chunk, monkeypatch):
    monkeypatch.setattr(video_mod, "CHUNK_FRAMES", chunk)
    parts = [load_video_part(video, SPEC, rank=r, sp=sp) for r in range(sp)]
    assert torch.equal(torch.cat([p.frames for p in parts]), whole.frames)
    for r, part in enumerate(parts):
        a, b = frame_ranges(7, sp)[r]  # the vision tower's split of the same 7 groups
        assert (part.rank, part.sp, part.groups, part.first_frame) == (r, sp, (a, b), 2 * a)
        assert part.frames.shape[0] == 2 * (b - a) and part.frames.dtype == torch.float32
        assert torch.equal(part.frames, whole.frames[2 * a: 2 * b])
        _same_whole_facts(part, whole)
        sliced = whole.part(r, sp)  # a whole decode (e.g. from the frame cache) cut the same way
        assert torch.equal(sliced.frames, part.frames) and sliced.groups == part.groups
        _same_whole_facts(sliced, whole)
    if sp == 1:
        again = parts[0].as_video()
        assert torch.equal(again.frames, whole.frames) and again.metadata == whole.metadata
    else:
        with pytest.raises(ValueError, match=f"rank 0 of sp {sp} holds frames 0..{parts[0].frames.shape[0]} of 14"):
            parts[0].as_video()


def test_a_clip_window_and_ranks_with_no_frames(video):
    # window 1.0..2.0 s: frames 8..16, 9 frames = 1.125 s x 2 fps -> 4 (min_frames): 2 groups over 4 ranks
    whole = _qwen_vl_utils(video, SPEC, 1.0, 2.0)
    assert whole.metadata["frames_indices"] == [8, 11, 13, 16]
    parts = [load_video_part(video, SPEC, 1.0, 2.0, rank=r, sp=4) for r in range(4)]
    assert [p.groups for p in parts] == frame_ranges(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    assert torch.equal(torch.cat([p.frames for p in parts]), whole.frames)
    assert parts[0].frames.shape == (0, *whole.frames.shape[1:])  # an empty part still has the whole's frame size
    for p in parts:
        _same_whole_facts(p, whole)


@pytest.mark.parametrize("case", ["missing", "corrupt", "window past the end"])
def test_errors_are_the_whole_decodes(video, tmp_path, case):
    path, clip = video, (None, None)
    if case == "missing":
        path = str(tmp_path / "gone.mp4")
    elif case == "corrupt":
        data = bytearray(open(video, "rb").read())
        data[len(data) // 4: 3 * len(data) // 4] = bytes(len(data) // 2)
        path = str(tmp_path / "corrupt.mp4")
        open(path, "wb").write(bytes(data))
    else:
        clip = (20.0, 30.0)
    with pytest.raises(VideoError) as want:
        load_video(path, SPEC, *clip)
    with pytest.raises(VideoError) as got:
        load_video_part(path, SPEC, *clip, rank=1, sp=2)
    assert str(got.value) == str(want.value) and str(got.value).startswith(f"{path}: ")


def test_part_groups_checks_its_arguments():
    assert [part_groups(7, r, 3) for r in range(3)] == frame_ranges(7, 3) == [(0, 2), (2, 4), (4, 7)]
    for rank, sp in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=f"rank {rank} of sp {sp}"):
            part_groups(7, rank, sp)
