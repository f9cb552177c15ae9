"""The trajectory tree in the grouped forward: each response a branch whose tool turns hold a zoom clip's frames.

One packed row [overview prompt | branch 1: text, clip, text, ... | branch 2 ...]; each branch attends to the prompt
and its own past; the vision tower sees the overview once and each clip once; a clip's positions are the model's own
for the whole conversation. Held against each branch's whole conversation forwarded alone by the model itself
(`repeated_logprobs` with the same clips): logprobs and every parameter's gradient, float32, tests/grouping_check.py's
bounds (1e-5 absolute, 1e-4 relative). Cases: both families, left and right padding, 0 to 3 clips per branch of
unequal sizes, several prompts per row (one without video), a video shared by its queries."""

from __future__ import annotations

import pytest
import torch
from batches import video_prompts as prompts
from batches import zoom_branches as branches
from grouping_check import compare

from mmpg.grouping import grouped_forward, grouped_logprobs, repeated_logprobs
from mmpg.grouping.inputs import merge_visuals

VL = ["qwen2_5_vl", "qwen3_vl"]
# prompts (video seeds; None: no video), group sizes, clips per branch
CASES = {
    "one_prompt": ([0], [4], [0, 1, 2, 3]),
    "several_prompts": ([0, None, 1], [2, 1, 3], [1, 0, 2, 0, 3, 1]),
    "shared_video": ([5, 5, 5], [2, 2, 1], [2, 0, 1, 1, 3]),
    "no_zoom_at_all": ([0, 1], [2, 1], [0, 0, 0]),
}


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", VL)
def test_trajectory_tree_equals_each_branch_alone(family, case, padding_side, load_tiny):
    model, processor = load_tiny(family)
    videos, group_sizes, zooms = CASES[case]
    inputs = prompts(processor, videos, padding_side)
    ids, mask, visuals = branches(model, processor, zooms, seed=len(zooms))
    clip_visuals = visuals if any(visuals) else None
    _, _, grads = compare(model, inputs, ids, mask, group_sizes, completion_visuals=clip_visuals)
    assert any(name.startswith("model.visual.") for name in grads)
    with torch.no_grad():
        out = grouped_forward(model, inputs, ids, mask, group_sizes, completion_visuals=clip_visuals)
    # the row holds each prompt (or shared part) once and each branch, clips included, once
    attn = inputs["attention_mask"].sum(1).tolist()
    if case == "shared_video":
        assert out.shared_parts < len(videos) and out.row_tokens < sum(attn) + int(mask.sum())
    else:
        assert out.shared_parts == len(videos) and out.row_tokens == sum(attn) + int(mask.sum())


@pytest.mark.parametrize("family", VL)
def test_clips_given_flat_or_per_row_alike(family, load_tiny):
    """The clips as one processor-style dict for all rows (row order) give what one dict per row gives."""
    model, processor = load_tiny(family)
    inputs = prompts(processor, [0, 1], "left")
    ids, mask, visuals = branches(model, processor, [2, 0, 1], seed=3)
    with torch.no_grad():
        per_row = grouped_logprobs(model, inputs, ids, mask, [2, 1], completion_visuals=visuals)
        flat = grouped_logprobs(model, inputs, ids, mask, [2, 1], completion_visuals=merge_visuals(visuals))
        ref = repeated_logprobs(model, inputs, ids, mask, [2, 1], completion_visuals=merge_visuals(visuals))
    assert torch.equal(per_row, flat)
    assert float((per_row - ref).abs().max()) <= 1e-5


def test_the_clips_positions_continue_the_conversation(load_tiny):
    """A Qwen2.5-VL clip's temporal positions start at its branch's running position (as every video's do in the
    model's own index) and the text after it continues one past the clip's largest position."""
    from mmpg.grouping.adapters import completion_positions, prefix_positions
    from mmpg.grouping.inputs import check_completions, completion_visuals_per_row

    model, processor = load_tiny("qwen2_5_vl")
    inputs = prompts(processor, [0], "left")
    ids, mask, visuals = branches(model, processor, [1], seed=1)
    start = prefix_positions(model, inputs).starts[0]
    completions = check_completions(inputs, ids, mask, [1])
    rows = completion_visuals_per_row(model, ids, mask, visuals)
    pos = completion_positions(model, completions, rows, [start])[0]
    video = ids[0] == model.config.video_token_id
    first = int(video.nonzero()[0])
    assert pos[:, :first].tolist() == [list(range(start, start + first))] * 3
    assert int(pos[0, first]) == start + first  # the clip's first temporal position: its running start
    after = int(video.nonzero()[-1]) + 1
    assert int(pos[0, after]) == int(pos[:, :after].max()) + 1


@pytest.mark.parametrize("family", VL)
def test_bad_clips_are_named(family, load_tiny):
    model, processor = load_tiny(family)
    inputs = prompts(processor, [0], "left")
    ids, mask, visuals = branches(model, processor, [1, 0], seed=2)
    with pytest.raises(ValueError, match="completion row 0 holds the vision placeholder"):
        grouped_logprobs(model, inputs, ids, mask, [2])  # clips in a row, none given
    with pytest.raises(ValueError, match="completion row 0 has 1?[0-9]+ video tokens but no video_grid_thw"):
        grouped_logprobs(model, inputs, ids, mask, [2], completion_visuals=[{}, visuals[0]])
    with pytest.raises(ValueError, match="1 videos given but the placeholders of completion row 1 cover 0"):
        grouped_logprobs(model, inputs, ids, mask, [2], completion_visuals=[visuals[0], visuals[0]])
    short = [{k: v[:-1] if k == "pixel_values_videos" else v for k, v in visuals[0].items()}, {}]
    with pytest.raises(ValueError, match="pixel_values_videos of completion row 0 has [0-9]+ rows but the video grids"):
        grouped_logprobs(model, inputs, ids, mask, [2], completion_visuals=short)
    with pytest.raises(ValueError, match="2 completion visual dicts for 3"):
        grouped_logprobs(model, inputs, torch.cat([ids, ids[:1]]), torch.cat([mask, mask[:1]]), [3],
                         completion_visuals=visuals)


def test_text_model_refuses_clips(load_tiny):
    model, tokenizer = load_tiny("qwen2")
    inputs = tokenizer(["a question"], return_tensors="pt")
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="without a vision tower"):
        grouped_logprobs(model, inputs, ids, mask, [1], completion_visuals=[{}])
