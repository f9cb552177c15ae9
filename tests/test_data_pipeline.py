"""Synthetic videos -> annotation loader -> DataLoader workers (qwen-vl-utils, decord) -> processor inputs -> the
grouped forward, for both Qwen-VL families: the path a training step takes, on data the project renders itself."""

from __future__ import annotations

import pytest
import torch

from mmpg.data.dataset import make_dataloader
from mmpg.data.formats import load_annotations
from mmpg.data.video import VideoSpec
from mmpg.grouping import grouped_logprobs, repeated_logprobs
from mmpg.toy.videos import generate_dataset


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "data"
    generate_dataset(out, n=4, seed=1, min_duration=4.0, max_duration=8.0, sizes=((128, 96), (96, 128)),
                     fps_choices=(8.0,))
    return out


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_synthetic_videos_to_grouped_forward(synth, family, load_tiny):
    model, processor = load_tiny(family)
    result = load_annotations(synth / "train.json", synth / "videos")
    assert result.samples and not result.skipped
    f = 28 if family == "qwen2_5_vl" else 32  # patch 14 or 16, merged 2x2
    spec = VideoSpec.for_family(family, fps=2.0, max_frames=8, min_pixels=4 * f * f, max_pixels=16 * f * f)
    loader = make_dataloader(result.samples, spec, batch_size=2, processor=processor, num_workers=1, shuffle=False)
    batch = next(iter(loader))
    assert len(batch) == 2 and not batch.skipped
    inputs = batch.inputs
    assert inputs["video_grid_thw"].shape[0] == 2 and "mm_token_type_ids" in inputs
    text = processor.tokenizer.decode(inputs["input_ids"][0])
    assert batch.samples[0].query in text and "<answer>" in text
    # the prompt states the duration the loader read
    assert f"{batch.samples[0].duration:.2f}" in text
    group_sizes = [2, 3]
    ids = torch.randint(0, model.config.text_config.vocab_size, (5, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        diff = (grouped_logprobs(model, inputs, ids, mask, group_sizes)
                - repeated_logprobs(model, inputs, ids, mask, group_sizes)).abs().max()
    assert diff <= 1e-5
