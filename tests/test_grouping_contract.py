"""What the grouped forward promises besides equal numbers: the vision tower sees B videos (not N), the sdpa backend
never copies the prefix K/V per response, and malformed input gets a clear ValueError."""

from __future__ import annotations

import pytest
import torch

import mmpg.grouping.backends.sdpa as sdpa_backend
from batches import completions, vl_batch
from mmpg.grouping import grouped_logprobs, repeated_logprobs

VIDEOS, GROUPS, LENGTHS = [(8, 56, 84), None, (4, 112, 56)], [3, 1, 4], [2, 5, 1, 3, 4, 4, 2, 6]


@pytest.fixture
def qwen25(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS)
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size)
    return model, inputs, ids, mask


def _count_vision_rows(model):
    seen = []
    handle = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    return seen, handle


def test_vision_tower_runs_once_per_prompt(qwen25):
    model, inputs, ids, mask = qwen25
    seen, handle = _count_vision_rows(model)
    with torch.no_grad():
        grouped_logprobs(model, inputs, ids, mask, GROUPS)
        grouped_calls = list(seen)
        seen.clear()
        repeated_logprobs(model, inputs, ids, mask, GROUPS)
    handle.remove()
    pixel_rows = inputs["pixel_values_videos"].shape[0]  # the two videos of the batch, once
    assert grouped_calls == [pixel_rows]
    # the naive forward encodes video b once per response: 3 x video 0 + 4 x video 2
    grid_rows = inputs["video_grid_thw"].prod(-1).tolist()
    assert seen == [3 * grid_rows[0] + 4 * grid_rows[1]]


def test_sdpa_backend_never_copies_prefix_kv(qwen25, monkeypatch):
    model, inputs, ids, mask = qwen25
    seen, storages, inside = [], [], []
    real = sdpa_backend.F.scaled_dot_product_attention  # torch's own; the vision tower calls it too

    def spy(q, k, v, **kw):
        if inside:
            seen.append((q.shape[2], k.shape[2], k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()))
        return real(q, k, v, **kw)

    real_grouped = sdpa_backend.sdpa_grouped_attention

    def grouped_spy(query, key, value, layout, scaling):
        storages.append((key.untyped_storage().data_ptr(), value.untyped_storage().data_ptr(), layout))
        inside.append(True)
        try:
            return real_grouped(query, key, value, layout, scaling)
        finally:
            inside.pop()

    monkeypatch.setattr(sdpa_backend.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(sdpa_backend, "sdpa_grouped_attention", grouped_spy)
    with torch.no_grad():
        grouped_logprobs(model, inputs, ids, mask, GROUPS, backend="sdpa")
    layers = model.config.text_config.num_hidden_layers
    assert len(storages) == layers and len(seen) == 2 * len(GROUPS) * layers
    layout = storages[0][2]
    for layer, (k_ptr, v_ptr, _) in enumerate(storages):
        calls = seen[layer * 2 * len(GROUPS):(layer + 1) * 2 * len(GROUPS)]
        for b in range(len(GROUPS)):
            P, R = layout.prefix_lens[b], sum(layout.response_lens[b])
            pre, resp = calls[2 * b], calls[2 * b + 1]
            assert (pre[0], pre[1]) == (P, P)
            assert (resp[0], resp[1]) == (R, P + R)  # keys: one prefix + the responses, not G prefixes
            # every key/value handed to SDPA is a view of the layer's own K/V: nothing copied
            assert pre[2:] == resp[2:] == (k_ptr, v_ptr)


@pytest.mark.parametrize("change, message", [
    (lambda ids, mask, g: (ids, mask, [3, 1, 3]), "sum to 7 but there are 8"),
    (lambda ids, mask, g: (ids, mask, [3, 0, 5]), "group size of prompt 1 is 0"),
    (lambda ids, mask, g: (ids, mask, [4, 4]), "2 group sizes for 3 prompts"),
    (lambda ids, mask, g: (ids, _hole(mask), g), "row 1 has a hole"),
    (lambda ids, mask, g: (ids, _empty(mask), g), "completion row 2 is empty"),
    (lambda ids, mask, g: (ids, mask[:, :-1], g), "must both be"),
])
def test_bad_input(qwen25, change, message):
    model, inputs, ids, mask = qwen25
    ids, mask, groups = change(ids, mask.clone(), GROUPS)
    for fn in (grouped_logprobs, repeated_logprobs):
        with pytest.raises(ValueError, match=message):
            fn(model, inputs, ids, mask, groups)


def _hole(mask):
    mask[1, 1] = 0  # row 1 has length 5: [1, 0, 1, 1, 1, 0]
    return mask


def _empty(mask):
    mask[2] = 0
    return mask
