"""The packed layout, the attention backends against a dense-mask reference, the LSE merge and its custom backward
(CPU, with the pure-torch stand-in kernel), and the patch entry point."""

from __future__ import annotations

import functools

import pytest
import torch

from mmpg.grouping import grouping_state
import torch.nn.functional as F

from mmpg.grouping import GroupLayout, apply_grouped_attention
from mmpg.grouping.backends import get_backend
from mmpg.grouping.backends.sdpa import sdpa_grouped_attention
from mmpg.grouping.backends.varlen import TorchVarlenKernel


def test_layout_positions_and_dense_rule():
    # [p0 p0 | a a a | b] [q0 q0 q0 | c c]
    layout = GroupLayout([2, 3], [[3, 1], [2]], torch.device("cpu"))
    assert layout.total == 2 + 3 + 1 + 3 + 2
    assert layout.prefix_index.tolist() == [0, 1, 6, 7, 8]
    assert layout.response_index.tolist() == [2, 3, 4, 5, 9, 10]
    # token 0 of a response is predicted by the group's last prefix token
    assert layout.predictor_index.tolist() == [1, 2, 3, 1, 8, 9]
    m = layout.dense_mask()
    assert m[4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # third token of a: prefix + a[:3]
    assert m[5].tolist() == [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0]  # b sees the prefix and itself only
    assert m[9].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0]  # group 1 never sees group 0
    cu, mx = layout.cu_seqlens("response")
    assert cu.tolist() == [0, 3, 4, 6] and mx == 3 and cu.dtype == torch.int32


def test_layout_rejects_empty_pieces():
    with pytest.raises(ValueError, match="at least|>= 1"):
        GroupLayout([2], [[0]], torch.device("cpu"))


def _dense_reference(q, k, v, layout, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask(), scale=scale).transpose(1, 2)


def _qkv(T, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, T, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv)]


LAYOUTS = {
    "unequal": ([5, 1, 7], [[1, 4, 2], [3], [2, 2, 6, 1]]),
    "equal": ([4, 9], [[3, 3, 3], [1, 1]]),
}


def _check_against_dense(fn, layout):
    q, k, v = _qkv(layout.total)
    out = fn(q, k, v, layout, 0.3)
    ref = _dense_reference(q, k, v, layout, 0.3)
    assert out.shape == ref.shape == (1, layout.total, 4, 8)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0), float((out - ref).abs().max())
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=0), f"d{name} differs by {float((a - b).abs().max())}"


@pytest.mark.parametrize("shape", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["sdpa", "lse_reference"])
def test_backend_matches_dense_mask_forward_and_backward(backend, shape):
    layout = GroupLayout(*LAYOUTS[shape], torch.device("cpu"), backend=backend)
    _check_against_dense(get_backend(backend), layout)


@pytest.mark.parametrize("shape", list(LAYOUTS))
@pytest.mark.parametrize("path", ["cpu", "masked"])
def test_both_sdpa_paths_match_dense_mask(path, shape):
    """The sdpa backend's CPU flash-kernel path and its masked path (the one other devices take), both on CPU."""
    layout = GroupLayout(*LAYOUTS[shape], torch.device("cpu"))
    _check_against_dense(functools.partial(sdpa_grouped_attention, path=path), layout)


def test_torch_kernel_backward_matches_autograd():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(7, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(7, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    kern = TorchVarlenKernel()
    out, lse = kern.forward(q.detach(), k.detach(), v.detach(), cu, cu, 4, 4, True, 0.35)
    dout = torch.randn_like(out)
    dq, dk, dv = kern.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, cu, cu, 4, 4, True, 0.35)
    # autograd reference: causal attention per segment
    ref = []
    for a, b in [(0, 3), (3, 7)]:
        qs, ks, vs = q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None]
        ref.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.35, enable_gqa=True)[0]
                   .transpose(0, 1))
    ref = torch.cat(ref)
    assert torch.allclose(out, ref, atol=1e-12)
    rq, rk, rv = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    for a, b in ((dq, rq), (dk, rk), (dv, rv)):
        assert torch.allclose(a, b, atol=1e-12)


def test_flex_forward_on_cpu_matches_dense_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    layout = GroupLayout([17, 9], [[3, 5, 1], [4, 4]], torch.device("cpu"), backend="flex")
    q, k, v = (x.detach().float() for x in _qkv(layout.total))
    with torch.no_grad():
        out = get_backend("flex")(q, k, v, layout, 0.3)
    ref = _dense_reference(q, k, v, layout, 0.3)
    assert torch.allclose(out, ref, atol=1e-5), float((out - ref).abs().max())


def test_patch_is_idempotent_and_text_only(load_tiny):
    model, _ = load_tiny("qwen2_5_vl")
    apply_grouped_attention(model)
    apply_grouped_attention(model)
    assert model.config.text_config._attn_implementation == "mmpg_grouped_sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"  # the vision tower keeps its own
    apply_grouped_attention(model, backend="lse_reference")
    assert grouping_state(model).backend == "lse_reference"
    assert model.config.text_config._attn_implementation == "mmpg_grouped_sdpa"


def test_patched_model_still_runs_its_own_forward(load_tiny):
    model, _ = load_tiny("qwen3")
    ids = torch.tensor([[3, 9, 27, 81, 243]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        apply_grouped_attention(model)
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_patched_eager_model(tiny_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen2"], attn_implementation="eager")
    apply_grouped_attention(model)
    assert model.config._attn_implementation == "mmpg_grouped_eager"
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_unsupported_model_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="does not support model_type 'llama'"):
        apply_grouped_attention(model)


def test_unknown_backend_is_refused(load_tiny):
    model, _ = load_tiny("qwen2")
    with pytest.raises(ValueError, match="unknown grouped attention backend 'fast'"):
        apply_grouped_attention(model, backend="fast")


def test_flash_loaded_models_keep_an_sdpa_ordinary_path():
    """transformers' flash path looks its kernel up by the configured name (ours after patching), so the wrapper for
    a flash base answers ordinary calls with sdpa, and builds sdpa's masks."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from mmpg.grouping.attention import register_grouped_attention

    name = register_grouped_attention("flash_attention_2")
    assert name == "mmpg_grouped_fa2"  # no "flash" in it: transformers would take it for a flash kernel (issue 15)
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is sdpa_mask

    class Module:
        is_causal, num_key_value_groups, training = True, 2, False

    q, k, v = (x.detach().float() for x in _qkv(6))
    out, _ = ALL_ATTENTION_FUNCTIONS[name](Module(), q, k, v, None, scaling=0.3)
    ref, _ = sdpa_attention_forward(Module(), q, k, v, None, scaling=0.3)
    assert torch.equal(out, ref)
