"""Models loaded with attn_implementation="flash_attention_2" take the grouped forward (issue 15, finding 1).

transformers 5.24 takes any attention implementation whose name contains "flash" for a flash kernel and tries to load
it when the name is set; mmpg's wrapper was registered as `mmpg_grouped_flash_attention_2` and crashed text-only
Qwen2/Qwen3 (`Could not find the currently requested flash attention implementation`). It is now `mmpg_grouped_fa2`.

The models are loaded the way a user on a GPU loads them — `from_pretrained(..., attn_implementation=
"flash_attention_2")` — on the CPU: our stand-in flash_attn package (tests/fake_flash_attn) is what transformers
imports, and transformers' three environment checks (package found with its metadata, a CUDA device present, flash
not yet imported) are told yes. The vision towers of the VL models then run transformers' own flash path through the
stand-in, in float32 under its test flag, so the comparison holds the fp32 bounds."""

from __future__ import annotations

import functools

import pytest
import torch

from batches import completions, text_batch, vl_batch
from flash_standin import standin_flash_attn
from grouping_check import compare


@pytest.fixture
def fake_flash(monkeypatch):
    yield from standin_flash_attn(monkeypatch)


@pytest.fixture
def transformers_sees_flash_attn(fake_flash, monkeypatch):
    import transformers.modeling_flash_attention_utils as fa_utils

    fake_flash.ALLOW_FP32 = True
    checks = dict(fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2])
    checks["general_availability_check"] = lambda *args, **kwargs: True
    checks["supported_devices"] = ((lambda: True, "cuda"),)
    monkeypatch.setitem(fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX, 2, checks)
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", lambda *args, **kwargs: True)
    for name in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                 "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        # restored after the test; _process_with_kvcache_kwargs_fn exists from transformers 5.19 only
        monkeypatch.setattr(fa_utils, name, getattr(fa_utils, name, None), raising=False)
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)
    import flash_attn

    calls = []
    varlen = flash_attn.flash_attn_varlen_func

    @functools.wraps(varlen)  # transformers reads the signature to choose the arguments it passes
    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return varlen(*args, **kwargs)

    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", counted)
    yield calls


def _load(tiny_dirs, family):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    path = tiny_dirs[family]
    if family in ("qwen2", "qwen3"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="flash_attention_2")
        return model, AutoTokenizer.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation="flash_attention_2")
    return model, AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_5_vl", "qwen3_vl"])
def test_flash_attention_2_loaded_model(family, tiny_dirs, transformers_sees_flash_attn):
    from mmpg.grouping import apply_grouped_attention

    model, processor = _load(tiny_dirs, family)
    text_config = model.config.get_text_config()
    assert text_config._attn_implementation == "flash_attention_2"
    apply_grouped_attention(model, backend="flash")  # crashed here for the text models before the rename
    assert text_config._attn_implementation == "mmpg_grouped_fa2"
    if family in ("qwen2", "qwen3"):
        inputs, groups, lengths = text_batch(processor, 3), [2, 1, 4], [3, 1, 8, 2, 5, 6, 1]
    else:
        assert model.config.vision_config._attn_implementation == "flash_attention_2"  # the tower keeps flash
        inputs, groups, lengths = vl_batch(processor, family, [(4, 56, 84), None], "left"), [2, 1], [3, 1, 4]
    ids, mask = completions(groups, lengths, text_config.vocab_size)
    logp, grad, _ = compare(model, inputs, ids, mask, groups)
    if family not in ("qwen2", "qwen3"):
        assert transformers_sees_flash_attn, "the vision tower did not run transformers' flash path"
    print(f"{family} loaded with flash_attention_2: max logprob diff {logp:.3g}, worst relative grad diff {grad:.3g}")


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_cascade_decoding_of_a_flash_loaded_model(family, tiny_dirs, transformers_sees_flash_attn):
    """Issue 30, defect 1: the cascade wrapper registered flash's 2-D mask function while its ordinary and prefill
    calls run sdpa, so a left-padded batch failed in the cascade prefill ("The size of tensor a (62) must match the
    size of tensor b (3)"). Cascade must decode the copy path's greedy tokens, with its logprobs."""
    from mmpg.rollout import HFEngine, SamplingParams

    model, processor = _load(tiny_dirs, family)
    inputs = text_batch(processor, 3) if family == "qwen2" else vl_batch(processor, family, [(4, 56, 84), None],
                                                                         "left")
    assert bool((inputs["attention_mask"] == 0).any()), "the batch must be left-padded"
    greedy = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())
    copy = HFEngine(model, processor, decode="copy").generate_groups(inputs, 2, greedy)
    cascade = HFEngine(model, processor, decode="cascade").generate_groups(inputs, 2, greedy)
    assert torch.equal(copy.completion_ids, cascade.completion_ids)
    assert float((copy.logprobs - cascade.logprobs).abs().max()) < 1e-5
    assert model.config.get_text_config()._attn_implementation == "flash_attention_2"
