"""Qwen2.5-VL's mRoPE index on the convention its checkpoints were trained with (`mmpg.grouping.positions`): every
block starts one past the largest position so far. Hand-computed positions, agreement with transformers' own
index where the two conventions coincide, padding, and `generate` continuing exactly where the forward puts a
response."""

from __future__ import annotations

import pytest
import torch
from batches import vl_batch

from mmpg.grouping import grouped_logprobs
from mmpg.grouping.positions import qwen_rope_index, use_qwen_positions

VIDEO = 2


def _model(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    return use_qwen_positions(model.eval()), processor


def _index(model, inputs, own: bool):
    """(positions [3, B, L], deltas [B, 1]) from ours (own=False) or transformers' class method (own=True)."""
    fn = type(model.model).get_rope_index if own else model.model.get_rope_index
    args = (model.model,) if own else ()
    return fn(*args, inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
              video_grid_thw=inputs.get("video_grid_thw"), second_per_grid_ts=inputs.get("second_per_grid_ts"),
              attention_mask=inputs["attention_mask"])


def test_installed_once_and_only_on_qwen2_5_vl(load_tiny, tiny_dirs):
    model, _ = _model(load_tiny)
    assert model.model.get_rope_index.__func__ is qwen_rope_index
    bound = model.model.get_rope_index
    assert use_qwen_positions(model).model.get_rope_index == bound  # idempotent
    other, _ = load_tiny("qwen3_vl")
    assert use_qwen_positions(other).model.get_rope_index.__func__ is type(other.model).get_rope_index
    from mmpg.models.loading import load_policy

    assert load_policy(tiny_dirs["qwen2_5_vl"]).model.get_rope_index.__func__ is qwen_rope_index


def test_long_video_hand_computed(load_tiny):
    """40 frames of 56x56 at 2 fps: grid T 20, H = W = 4 patches, 2x2 after merging; second_per_grid 1 s, 2 tokens
    per second, so the temporal positions step by 2 and reach start + 38, far past the spatial start + 1."""
    model, processor = _model(load_tiny)
    inputs = vl_batch(processor, "qwen2_5_vl", [(40, 56, 56)])
    assert inputs["video_grid_thw"].tolist() == [[20, 4, 4]] and inputs["second_per_grid_ts"].tolist() == [1.0]
    pos, delta = _index(model, inputs, own=False)
    types = inputs["mm_token_type_ids"][0]
    video = (types == VIDEO).nonzero()[:, 0]
    first, last = int(video[0]), int(video[-1])
    assert last - first + 1 == 20 * 2 * 2
    start = first  # text before the video: 0 .. first - 1
    assert pos[:, 0, :first].tolist() == [list(range(first))] * 3
    t = torch.arange(20).repeat_interleave(4) * 2 + start
    hw = torch.tensor([0, 0, 1, 1] * 20) + start, torch.tensor([0, 1, 0, 1] * 20) + start
    assert pos[0, 0, first:last + 1].tolist() == t.tolist()
    assert pos[1, 0, first:last + 1].tolist() == hw[0].tolist()
    assert pos[2, 0, first:last + 1].tolist() == hw[1].tolist()
    after = pos[:, 0, last + 1:]
    expected = torch.arange(after.shape[1]) + start + 38 + 1  # one past the video's largest position
    assert (after == expected).all()
    assert int(delta) == start + 39 + after.shape[1] - types.numel()
    # transformers 5.x continues at start + max(H, W) / merge = start + 2 instead: what this module exists for
    theirs, _ = _index(model, inputs, own=True)
    assert int(theirs[0, 0, last + 1]) == start + 2
    assert (theirs[:, 0, :last + 1] == pos[:, 0, :last + 1]).all()  # the same up to the end of the video


def test_short_video_agrees_with_transformers(load_tiny):
    """Where the temporal extent stays below the spatial one the two conventions are the same positions."""
    model, processor = _model(load_tiny)
    inputs = vl_batch(processor, "qwen2_5_vl", [(4, 56, 84), None, (2, 84, 84)])
    ours, our_delta = _index(model, inputs, own=False)
    theirs, their_delta = _index(model, inputs, own=True)
    assert torch.equal(ours, theirs) and torch.equal(our_delta, their_delta)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_padding_is_zero_and_rows_are_their_own(load_tiny, padding_side):
    model, processor = _model(load_tiny)
    specs = [(40, 56, 56), None, (4, 56, 84)]
    batch = vl_batch(processor, "qwen2_5_vl", specs, padding_side=padding_side)
    pos, deltas = _index(model, batch, own=False)
    for b, spec in enumerate(specs):
        keep = batch["attention_mask"][b].bool()
        assert (pos[:, b, ~keep] == 0).all()
        # vl_batch picks question and video seed by prompt index: prompt b again, after b text-only prompts
        alone = vl_batch(processor, "qwen2_5_vl", [None] * b + [spec])
        row = alone["attention_mask"].shape[0] - 1
        p, d = _index(model, {k: v[row:] if k in ("input_ids", "mm_token_type_ids", "attention_mask") else v
                              for k, v in alone.items()}, own=False)
        assert torch.equal(pos[:, b, keep], p[:, 0, alone["attention_mask"][row].bool()]) and int(deltas[b]) == int(d)


def test_too_few_grids_is_a_clear_error(load_tiny):
    model, processor = _model(load_tiny)
    inputs = vl_batch(processor, "qwen2_5_vl", [(4, 56, 56)])
    with pytest.raises(ValueError, match="more video tokens than its grids"):
        model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                   video_grid_thw=inputs["video_grid_thw"][:0], attention_mask=inputs["attention_mask"])


def test_generate_continues_where_the_grouped_forward_puts_responses(load_tiny):
    """`generate` on a patched model (what eval's speed baseline and users' scripts call) reads the same positions as
    the grouped forward after a long video: greedy `generate`'s own logprobs equal `grouped_logprobs` of its tokens
    (float32, 1e-5)."""
    model, processor = _model(load_tiny)
    inputs = vl_batch(processor, "qwen2_5_vl", [(40, 56, 56)])
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=6, min_new_tokens=6, output_logits=True,
                             return_dict_in_generate=True)
        new = out.sequences[:, inputs["input_ids"].shape[1]:]
        theirs = torch.stack([torch.log_softmax(step.float(), -1)[0, tok] for step, tok in zip(out.logits, new[0])])
        ours = grouped_logprobs(model, inputs, new, torch.ones_like(new), [1])[0]
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
