"""Prompt inputs of a rank that decoded only its part of each video (`mmpg.data.prompts`, `VideoPart`): the prompt
(ids, mask, token types, grid, Qwen2.5-VL's seconds per grid) is exactly the whole video's, and the pixel rows are
exactly the whole inputs' rows of the rank's temporal patch groups, for both families' processors (the tiny ones
and, when ../shared is there, the released Qwen2.5-VL and Qwen3-VL processor files), left and right padding, a video
asked twice, videos of different sizes, and ranks with no frame of a video."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batches import random_video

from mmpg.data.prompts import PromptTemplate, build_prompt_inputs
from mmpg.data.samples import GroundingSample
from mmpg.data.video import DecodedVideo, VideoPart
from mmpg.grouping.inputs import VIDEO_PART, check_whole_videos, part_span, pixel_rows, split_visuals_per_prompt

REAL = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "real" / "processors"
ASK = PromptTemplate("The video lasts {duration} seconds. Where is {query}?", think=False)


def _video(frames: int, h: int, w: int, seed: int) -> DecodedVideo:
    indices = [3 + 7 * i for i in range(frames)]
    meta = {"fps": 24.0, "total_num_frames": 300, "frames_indices": indices, "video_backend": "decord"}
    return DecodedVideo(frames=random_video(frames, h, w, seed).float(), timestamps=[i / 24 for i in indices],
                        sample_fps=24 / 7, metadata=meta, path=f"v{seed}.mp4", duration=12.5)


def _processor(name: str):
    if name.startswith("real/"):
        folder = REAL / name.split("/")[1]
        if not (folder / "vocab.json").is_file():
            pytest.skip("the real processor files (../shared/data/real/processors) are absent")
        from mmpg.models.loading import load_processor

        return load_processor(folder)
    from mmpg.toy.models import build_tiny_processor

    return build_tiny_processor(name, seed=0)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "real/qwen2_5_vl", "real/qwen3_vl"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_ranks_inputs_are_the_whole_prompt_and_its_rows(name, side):
    processor = _processor(name)
    vp = processor.video_processor
    f = vp.patch_size * vp.merge_size
    a, b = _video(14, 2 * f, 3 * f, seed=1), _video(6, 3 * f, f, seed=2)  # 7 and 3 temporal patches
    samples = [GroundingSample(sample_id=f"s{i}", video=v.path, duration=12.5, query=q, span=(1.0, 2.0))
               for i, (v, q) in enumerate([(a, "the cat"), (a, "a door that opens slowly"), (b, "the dog")])]
    videos = [a, a, b]
    whole = build_prompt_inputs(processor, samples, videos, ASK, padding_side=side)
    whole_rows = split_visuals_per_prompt(_geometry(processor), whole)
    for sp in (2, 3, 4):
        held = []
        for rank in range(sp):
            parts = [v.part(rank, sp) for v in videos]
            got = build_prompt_inputs(processor, samples, parts, ASK, padding_side=side)
            assert set(got) == set(whole) | {VIDEO_PART}, set(got) ^ set(whole)
            for key in whole:
                if key != "pixel_values_videos":
                    assert torch.equal(got[key], whole[key]), (key, sp, rank)
            assert got[VIDEO_PART].tolist() == [[rank, sp]] * 3
            want = []
            for p, (t, h, w) in zip(split_visuals_per_prompt(_geometry(processor), whole),
                                    whole["video_grid_thw"].tolist()):
                lo, hi = part_span(t, rank, sp)
                want.append(p["pixel_values_videos"][lo * h * w: hi * h * w])
            assert torch.equal(got["pixel_values_videos"], torch.cat(want)), (sp, rank)
            assert pixel_rows(got) == [x.shape[0] for x in want]
            # each prompt's own rows, as the grouped forward and the batching split them
            mine = split_visuals_per_prompt(_geometry(processor), got)
            for m, w_, x in zip(mine, whole_rows, want):
                assert torch.equal(m["pixel_values_videos"], x) and torch.equal(m["video_grid_thw"], w_["video_grid_thw"])
                assert m[VIDEO_PART].tolist() == [[rank, sp]]
            held.append(got["pixel_values_videos"].shape[0])
        assert sum(held) == whole["pixel_values_videos"].shape[0]  # the ranks' parts add up to the whole, no more
    with pytest.raises(ValueError, match=r"needs whole videos.*rank 1 of 2"):
        check_whole_videos(build_prompt_inputs(processor, samples, [v.part(1, 2) for v in videos], ASK), "this")


def test_a_rank_with_no_frame_of_any_video():
    processor = _processor("qwen2_5_vl")
    f = processor.video_processor.patch_size * processor.video_processor.merge_size
    v = _video(2, f, f, seed=3)  # one temporal patch over 2 ranks: rank 0 holds nothing
    sample = GroundingSample(sample_id="s", video=v.path, duration=12.5, query="it", span=(1.0, 2.0))
    whole = build_prompt_inputs(processor, [sample], [v], ASK)
    empty = build_prompt_inputs(processor, [sample], [v.part(0, 2)], ASK)
    assert empty["pixel_values_videos"].shape == (0, whole["pixel_values_videos"].shape[1])
    assert torch.equal(empty["input_ids"], whole["input_ids"])
    full = build_prompt_inputs(processor, [sample], [v.part(1, 2)], ASK)
    assert torch.equal(full["pixel_values_videos"], whole["pixel_values_videos"])


def test_parts_and_whole_videos_do_not_mix():
    processor = _processor("qwen2_5_vl")
    f = processor.video_processor.patch_size * processor.video_processor.merge_size
    v = _video(4, f, f, seed=4)
    samples = [GroundingSample(sample_id=f"s{i}", video=v.path, duration=12.5, query="it", span=(1.0, 2.0))
               for i in range(2)]
    with pytest.raises(ValueError, match="all one sequence-parallel rank's parts, or all whole"):
        build_prompt_inputs(processor, samples, [v.part(0, 2), v], ASK)
    with pytest.raises(ValueError, match="all one sequence-parallel rank's parts, or all whole"):
        build_prompt_inputs(processor, samples, [v.part(0, 2), v.part(1, 2)], ASK)
    # a part of sp 1 is the whole video
    one = build_prompt_inputs(processor, samples, [v.part(0, 1)] * 2, ASK)
    assert VIDEO_PART not in one and torch.equal(one["pixel_values_videos"],
                                                 build_prompt_inputs(processor, samples, [v, v], ASK)[
                                                     "pixel_values_videos"])


class _Config:
    def __init__(self, processor):
        tok = processor.tokenizer
        self.video_token_id = tok.convert_tokens_to_ids(processor.video_token)
        self.image_token_id = tok.convert_tokens_to_ids(processor.image_token)
        self.vision_config = type("V", (), {"spatial_merge_size": processor.video_processor.merge_size})()


def _geometry(processor):
    """The little of a model `split_visuals_per_prompt` reads: its placeholder ids and merge size."""
    return type("M", (), {"config": _Config(processor)})()
