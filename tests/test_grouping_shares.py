"""One video, many questions (`mmpg.grouping.shares`): adjacent prompts that begin alike (a video's queries) share that
leading part in the grouped forward, found from the inputs alone. Exactness against the per-query repeated forward
(logprobs within 1e-5, every parameter's gradient, vision tower included, within 1e-4 relative, float32), for videos
shared by 1, 2 and 4 queries, tails of unequal length, unequal group sizes, left and right padding, shared and unshared
videos mixed, and two different videos under identical text (never shared); the vision tower sees each shared video
once."""

from __future__ import annotations

import pytest
import torch

from batches import completions, processor_batch, random_video
from grouping_check import compare
from mmpg.grouping import grouped_logprobs
from mmpg.grouping.adapters import prefix_positions
from mmpg.grouping.shares import find_shares

def _shares(model, inputs, vl: bool, group_sizes):
    from mmpg.grouping.inputs import placeholder_token_ids, split_visuals_per_prompt

    visuals = split_visuals_per_prompt(model, inputs) if vl else [{} for _ in group_sizes]
    return find_shares(prefix_positions(model, inputs), visuals, placeholder_token_ids(model), group_sizes)


QUESTIONS = ["When does the red circle appear?", "Find the moment the blue square moves to the left side.",
             "When is it?", "Where does the yellow triangle first become visible in the frame?"]


def shared_batch(processor, prompts, padding_side="left"):
    """prompts: (video key or None, question index); the same key means the same frames (seeded by the key)."""
    texts, videos, metadata = [], [], []
    specs = {"a": (16, 112, 112, 1), "b": (4, 112, 56, 2), "c": (16, 112, 112, 3), "c2": (16, 112, 112, 4)}
    for key, q in prompts:
        content = ([{"type": "video"}] if key else []) + [{"type": "text", "text": QUESTIONS[q]}]
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True))
        if key:
            frames, h, w, seed = specs[key]
            videos.append(random_video(frames, h, w, seed=seed))
            metadata.append({"fps": 2.0, "total_num_frames": frames, "frames_indices": list(range(frames))})
    return processor_batch(processor, texts, videos, metadata, padding_side)


# video a asked 4 times, b once, c twice, a text prompt, c2 (other frames, same size) with c's question
PROMPTS = [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0), ("c", 1), ("c", 2), (None, 3), ("c2", 2)]
GROUPS = [2, 3, 1, 2, 2, 3, 1, 2, 2]
LENGTHS = [3, 5, 2, 4, 6, 1, 2, 3, 5, 4, 4, 2, 6, 3, 5, 2, 4, 1]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_shared_video_equals_the_per_query_forward(load_tiny, family, padding_side):
    model, processor = load_tiny(family)
    inputs = shared_batch(processor, PROMPTS, padding_side)
    shares = _shares(model, inputs, True, GROUPS)
    assert [s.prompts for s in shares] == [(0, 1, 2, 3), (4,), (5, 6), (7,), (8,)]  # c2 is not c: not shared
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size)
    logp, grad, grads = compare(model, inputs, ids, mask, GROUPS)
    assert any("visual" in name for name in grads)  # the vision tower's gradients are compared too
    print(f"{family} {padding_side}: shared vs repeated max logprob diff {logp:.3g}, worst grad {grad:.3g}")


def test_vision_tower_sees_each_shared_video_once(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    inputs = shared_batch(processor, PROMPTS)
    rows = (inputs["video_grid_thw"].prod(-1)).tolist()  # a, a, a, a, b, c, c, c2
    seen = []
    handle = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size)
    with torch.no_grad():
        grouped_logprobs(model, inputs, ids, mask, GROUPS)
    handle.remove()
    assert seen == [rows[0] + rows[4] + rows[5] + rows[7]]  # a, b, c, c2 once each (not 8 videos)


def test_different_frames_or_text_before_the_video_never_share(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    inputs = shared_batch(processor, [("c", 2), ("c2", 2), ("c", 2)])  # same text, same size; c2's frames differ
    shares = _shares(model, inputs, True, [2, 2, 2])
    assert [s.prompts for s in shares] == [(0,), (1,), (2,)]
    same = shared_batch(processor, [("c", 2), ("c", 2)])  # the same prompt twice: shared, each tail >= 1 token
    shares = _shares(model, same, True, [2, 3])
    assert [s.prompts for s in shares] == [(0, 1)]
    assert shares[0].length == int(same["attention_mask"][0].sum()) - 1
    ids, mask = completions([2, 3], [3, 1, 4, 2, 5], model.config.text_config.vocab_size)
    compare(model, same, ids, mask, [2, 3])


def test_sharing_only_where_it_saves_tokens(load_tiny):
    """Tails are repeated per response, so a short common opening before different questions is not shared (3
    tokens of chat header, questions of 10-40 tokens, G 2-3), while the same text prompt twice is."""
    from batches import text_batch
    from mmpg.grouping.shares import packed_tokens

    assert packed_tokens([2030, 2030, 2040], [8, 8, 8], 2000) == 2000 + 8 * (30 + 30 + 40)  # 2,800 < 6,100 alone
    model, tokenizer = load_tiny("qwen3")
    inputs = text_batch(tokenizer, 3)
    shares = _shares(model, inputs, False, [2, 1, 3])
    assert [s.prompts for s in shares] == [(0,), (1,), (2,)]
    twice = tokenizer([inputs_text := tokenizer.decode(inputs["input_ids"][2][inputs["attention_mask"][2].bool()])] * 2,
                      return_tensors="pt", padding=True)
    del inputs_text
    shares = _shares(model, twice, False, [2, 3])
    assert [s.prompts for s in shares] == [(0, 1)]
    ids, mask = completions([2, 3], [3, 2, 4, 1, 5], model.config.vocab_size)
    compare(model, twice, ids, mask, [2, 3])
