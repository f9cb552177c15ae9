"""A video shared wherever its queries sit in the batch (`mmpg.grouping.shares.share_order`): the grouped forward and
the HF engine compute a video's prompts side by side and give the results back in the caller's order. The batch
[A q1, A q2, B, A q3, B q2]: two videos encoded, once each; exact against the per-row repeated forward (logprobs
1e-5, every gradient 1e-4 relative, float32, both VL families); the engine samples what it samples for the batch in
video order."""

from __future__ import annotations

import pytest
import torch

from batches import completions
from grouping_check import compare
from mmpg.grouping import grouped_forward
from mmpg.grouping.inputs import split_visuals_per_prompt
from mmpg.grouping.shares import share_order
from mmpg.rollout import HFEngine, SamplingParams
from test_grouping_shares import shared_batch

APART = [("a", 0), ("a", 1), ("b", 0), ("a", 3), ("b", 2)]
GROUPS = [2, 3, 1, 2, 2]
LENGTHS = [3, 5, 2, 4, 6, 1, 2, 7, 3, 4]


def _vision_rows(model, fn):
    seen = []
    handle = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    try:
        out = fn()
    finally:
        handle.remove()
    return out, seen


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_video_apart_in_the_batch_is_encoded_once_and_exact(load_tiny, family):
    model, processor = load_tiny(family)
    inputs = shared_batch(processor, APART)
    assert share_order(split_visuals_per_prompt(model, inputs)) == [0, 1, 3, 2, 4]
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size)
    logp, grad, _ = compare(model, inputs, ids, mask, GROUPS)
    grid = inputs["video_grid_thw"].prod(-1).tolist()  # a, a, b, a, b
    with torch.no_grad():
        out, seen = _vision_rows(model, lambda: grouped_forward(model, inputs, ids, mask, GROUPS))
    assert seen == [grid[0] + grid[2]]  # one call: a and b once each
    assert (out.prompts, out.shared_parts, out.shared_prompts) == (5, 2, 3)  # 5 prompts behind 2 shared parts
    print(f"{family}: apart batch vs repeated max logprob diff {logp:.3g}, worst grad {grad:.3g}")


def test_the_same_question_twice_then_another_shares_the_video(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    prompts, groups = [("a", 0), ("a", 0), ("a", 1)], [2, 2, 2]
    inputs = shared_batch(processor, prompts)
    ids, mask = completions(groups, [3, 4, 2, 5, 1, 3], model.config.text_config.vocab_size)
    compare(model, inputs, ids, mask, groups)
    with torch.no_grad():
        out = grouped_forward(model, inputs, ids, mask, groups)
    assert (out.prompts, out.shared_parts) == (3, 1)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_engine_shares_a_video_apart_and_answers_in_order(load_tiny, family):
    model, processor = load_tiny(family)
    inputs = shared_batch(processor, APART)
    together = shared_batch(processor, [APART[i] for i in (0, 1, 3, 2, 4)])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5)
    seeds = [11, 12, 13, 14, 15]
    engine = HFEngine(model, processor, decode="cascade")
    out, seen = _vision_rows(model, lambda: engine.generate_groups(inputs, GROUPS, sampling, prompt_seeds=seeds))
    grid = inputs["video_grid_thw"].prod(-1).tolist()
    assert seen == [grid[0] + grid[2]] and engine.last_stats["prefixes"] == 2
    ref = engine.generate_groups(together, [GROUPS[i] for i in (0, 1, 3, 2, 4)], sampling,
                                 prompt_seeds=[seeds[i] for i in (0, 1, 3, 2, 4)])
    rows = [list(range(0, 2)), list(range(2, 5)), list(range(5, 6)), list(range(6, 8)), list(range(8, 10))]
    ref_rows = [r for b in (0, 1, 3, 2, 4) for r in rows[b]]  # the reference's row j answers caller row ref_rows[j]
    back = torch.tensor(ref_rows).argsort()
    assert [ref.texts[j] for j in back.tolist()] == out.texts
    assert torch.equal(ref.completion_ids[back][:, :out.completion_ids.shape[1]], out.completion_ids)
    assert out.group_sizes == GROUPS
