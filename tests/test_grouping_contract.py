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


def _record_kernel_calls(monkeypatch, model, inputs, ids, mask, path):
    """Run the grouped forward with the sdpa backend on `path`; return (calls, [(layout, K storage)] per layer), a
    call being (kernel, q batch, q length, k batch, k length, K storage) seen inside the grouped attention only."""
    calls, layers, inside = [], [], []

    def record(module, name):
        real = getattr(module, name)

        def spy(q, k, v, *args, **kw):
            if inside:  # the vision tower calls torch's SDPA too
                calls.append((name, q.shape[0], q.shape[2], k.shape[0], k.shape[2], k.untyped_storage().data_ptr()))
            return real(q, k, v, *args, **kw)

        monkeypatch.setattr(module, name, spy)

    record(sdpa_backend, "_flash_cpu")
    record(sdpa_backend.F, "scaled_dot_product_attention")
    real_grouped = sdpa_backend.sdpa_grouped_attention

    def grouped_spy(query, key, value, layout, scaling):
        layers.append((layout, key.untyped_storage().data_ptr()))
        inside.append(True)
        try:
            return real_grouped(query, key, value, layout, scaling, path=path)
        finally:
            inside.pop()

    monkeypatch.setattr(sdpa_backend, "sdpa_grouped_attention", grouped_spy)
    with torch.no_grad():
        grouped_logprobs(model, inputs, ids, mask, GROUPS, backend="sdpa")
    assert len(layers) == model.config.text_config.num_hidden_layers
    return calls, layers


def test_sdpa_backend_cpu_path_never_copies_prefix_kv_per_response(qwen25, monkeypatch):
    """Per group and layer, the prefix keys reach a kernel twice with batch 1 (prefix queries; all response queries
    at once) and the own-response part as a [G_b, S_max] batch. Nothing of size G_b x P_b is ever built."""
    model, inputs, ids, mask = qwen25
    calls, layers = _record_kernel_calls(monkeypatch, model, inputs, ids, mask, "cpu")
    assert len(calls) == 3 * len(GROUPS) * len(layers)
    for layer, (layout, _) in enumerate(layers):
        per_layer = calls[layer * 3 * len(GROUPS):(layer + 1) * 3 * len(GROUPS)]
        for b in range(len(GROUPS)):
            P, lens = layout.prefix_lens[b], layout.response_lens[b]
            prefix, to_prefix, own = per_layer[3 * b: 3 * b + 3]
            assert prefix[1:5] == (1, P, 1, P)  # prefix queries -> prefix keys
            assert to_prefix[1:5] == (1, sum(lens), 1, P)  # all responses -> the prefix keys, once
            assert own[1:5] == (len(lens), max(lens), len(lens), max(lens))  # responses batched, own keys only


def test_sdpa_backend_masked_path_reads_kv_in_place(qwen25, monkeypatch):
    """The masked path (other devices): the prefix call reads the layer's own K in place; the response call gets
    one prefix + the responses (GQA heads expanded once per group), never G_b prefixes."""
    model, inputs, ids, mask = qwen25
    calls, layers = _record_kernel_calls(monkeypatch, model, inputs, ids, mask, "masked")
    assert len(calls) == 2 * len(GROUPS) * len(layers)
    for layer, (layout, k_ptr) in enumerate(layers):
        per_layer = calls[layer * 2 * len(GROUPS):(layer + 1) * 2 * len(GROUPS)]
        for b in range(len(GROUPS)):
            P, R = layout.prefix_lens[b], sum(layout.response_lens[b])
            pre, resp = per_layer[2 * b], per_layer[2 * b + 1]
            assert (pre[2], pre[4]) == (P, P)
            assert (resp[1], resp[2], resp[3], resp[4]) == (1, R, 1, P + R)  # one prefix + responses, not G prefixes
            assert pre[5] == k_ptr  # a view of the layer's K: nothing copied


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


def test_vision_placeholder_in_a_response_is_refused(qwen25):
    model, inputs, ids, mask = qwen25
    ids = ids.clone()
    ids[4, 2] = model.config.video_token_id  # row 4 has 4 tokens
    for fn in (grouped_logprobs, repeated_logprobs):
        with pytest.raises(ValueError, match=f"row 4 holds the vision placeholder id {model.config.video_token_id}"):
            fn(model, inputs, ids, mask, GROUPS)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_non_positive_temperature_is_refused(qwen25, temperature):
    model, inputs, ids, mask = qwen25
    for fn in (grouped_logprobs, repeated_logprobs):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            fn(model, inputs, ids, mask, GROUPS, temperature=temperature)


def test_temperature_scales_both_paths_alike(qwen25):
    model, inputs, ids, mask = qwen25
    with torch.no_grad():
        g = grouped_logprobs(model, inputs, ids, mask, GROUPS, temperature=0.7)
        r = repeated_logprobs(model, inputs, ids, mask, GROUPS, temperature=0.7)
        plain = grouped_logprobs(model, inputs, ids, mask, GROUPS)
    assert float((g - r).abs().max()) <= 1e-5
    assert float((g - plain).abs().max()) > 1e-3  # the temperature is applied, not ignored


def test_transformers_older_than_the_tested_minimum_is_refused(monkeypatch):
    """Releases older than the version matrix's oldest (5.17.0) are refused with the range to install."""
    import mmpg.grouping.patch as patch

    monkeypatch.setattr(patch.transformers, "__version__", "5.16.1")
    with pytest.raises(RuntimeError, match=r"tested on transformers >=5\.17\.0,<6\.0\.0.*found 5\.16\.1"):
        patch._check_transformers()
    monkeypatch.setattr(patch.transformers, "__version__", "5.17.0")
    patch._check_transformers()


@pytest.mark.parametrize("family, name, missing", [("qwen2_5_vl", "forward", "pixel_values_videos"),
                                                   ("qwen3_vl", "get_rope_index", "mm_token_type_ids"),
                                                   ("qwen2_5_vl", "get_vision_position_ids", None)])
def test_a_missing_feature_is_named_with_the_version(load_tiny, family, name, missing):
    """The gate checks what the grouped forward calls (signatures, attributes), one line naming the feature."""
    import mmpg.grouping.patch as patch

    model, _ = load_tiny(family)
    inner = model.model
    if missing is None:
        inner.__dict__[name] = None  # shadows the method: the release has no such function
    else:
        inner.__dict__[name] = lambda input_ids=None, **kwargs: None  # a signature without `missing`
    try:
        with pytest.raises(RuntimeError, match=f"transformers .*{name} no longer .*mmpg's grouped forward needs it"):
            patch._check_features(model)
    finally:
        del inner.__dict__[name]
    patch._check_features(model)


def test_tripwire_catches_a_visual_input_the_model_ignores(qwen25, monkeypatch):
    """The transformers <= 5.17 failure reintroduced: the model's forward lets the video fall through `**kwargs`
    (here: renamed so that no parameter takes it) down to the attention function. Without the tripwire this forward
    runs, on plain token embeddings; with it, one error names the key and the transformers version."""
    import transformers

    import mmpg.grouping.adapters as adapters
    from mmpg.grouping.attention import IgnoredInputError

    model, inputs, ids, mask = qwen25
    # an input this release's forward has no parameter for, as `mm_encoder_outputs` was for 5.17
    monkeypatch.setattr(adapters, "VISUAL_INPUTS", adapters.VISUAL_INPUTS + ("video_features_of_a_newer_release",))
    inputs = dict(inputs, video_features_of_a_newer_release=torch.zeros(1))
    with torch.no_grad(), pytest.raises(IgnoredInputError) as err:
        grouped_logprobs(model, inputs, ids, mask, GROUPS)
    text = str(err.value)
    assert text.startswith("grouped forward: video_features_of_a_newer_release handed to the model's forward")
    assert f"transformers {transformers.__version__}" in text


def test_cascade_tripwire_catches_an_ignored_cache(load_tiny):
    """The cascade engine hands the cache under the name this release's forward takes; under a wrong name (here:
    forced, as a release that renamed it would) it reaches the attention function, and the prefill raises instead
    of filling no cache."""
    from mmpg.grouping.attention import IgnoredInputError
    from mmpg.rollout import HFEngine, SamplingParams

    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", [(4, 56, 56)])
    engine = HFEngine(model, processor, decode="cascade")
    engine._cache_kwarg = "mmpg_not_a_cache_argument"
    with pytest.raises(IgnoredInputError, match="cascade decoding: mmpg_not_a_cache_argument handed to"):
        engine.generate_groups(inputs, 2, SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))
