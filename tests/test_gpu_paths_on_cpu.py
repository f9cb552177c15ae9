"""GPU-path defects of issue 15 that can be checked on a CPU: dtype unification before the kernel (finding 6),
FlexAttention's block mask compiled without the deprecated flag (8), layout tensors on each layer's device (10), the
masked SDPA path with and without the GQA copy (7). Findings 1, 4 and 5 are in test_flash_loaded_models.py and
test_flash_standin.py; the GPU check's report (2) is `mmpg doctor`'s, in test_doctor.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from batches import completions, vl_batch
from flash_standin import standin_flash_attn
from mmpg.grouping import GroupLayout, grouped_logprobs, repeated_logprobs
from mmpg.grouping.attention import LAYOUT_KWARG, register_grouped_attention
from mmpg.grouping.backends import BACKENDS, compute_dtype, get_backend


@pytest.fixture
def fake_flash(monkeypatch):
    yield from standin_flash_attn(monkeypatch)


LAYOUT = ([5, 1, 7], [[1, 4, 2], [3], [2, 2, 6, 1]])


def _qkv(T, dtype=torch.float64, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, T, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv)]


class _Layer(torch.nn.Module):
    """What the registered attention function sees of a layer: `is_causal`, GQA groups, a projection's dtype."""

    is_causal, num_key_value_groups = True, 2

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8, dtype=dtype)


def _dense_reference(q, k, v, layout):
    """[1, T, Hq, D] attention under the layout's rule, float64."""
    rep = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(rep, 1).transpose(-1, -2) * 0.3
    s = s.masked_fill(~layout.dense_mask(), float("-inf"))
    return (s.softmax(-1) @ v.double().repeat_interleave(rep, 1)).transpose(1, 2)


# ---- finding 6: one dtype before the kernel -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["sdpa", "lse_reference", "flash"])
def test_mixed_qkv_under_autocast_reach_the_backend_in_one_dtype(backend, fake_flash):
    """fp32 weights under bf16 autocast: q/k fp32 (bf16 projections times fp32 rotary tables), v bf16. They reach the
    backend in bf16, as transformers' own flash wrapper casts them; flash (the stand-in refuses fp32 here, like the
    real kernel) and the CPU sdpa path failed on the mixed inputs before."""
    layout = GroupLayout(*LAYOUT, torch.device("cpu"), backend=backend)
    q, k, v = _qkv(layout.total, torch.float32)
    v = v.to(torch.bfloat16)
    fn = ALL_ATTENTION_FUNCTIONS[register_grouped_attention("sdpa")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = fn(_Layer(), q, k, v, None, scaling=0.3, **{LAYOUT_KWARG: layout})
    assert out.dtype == torch.bfloat16
    ref = _dense_reference(q.bfloat16(), k.bfloat16(), v, layout)
    # bf16: the output is rounded once or twice (once per part, then the merge); 0.02 is about 2.5 bf16 ulps at 1
    torch.testing.assert_close(out.double(), ref, atol=0.02, rtol=0.02)


def test_mixed_qkv_without_autocast_take_the_projection_dtype():
    layout = GroupLayout(*LAYOUT, torch.device("cpu"))
    q, k, v = _qkv(layout.total, torch.float32)
    fn = ALL_ATTENTION_FUNCTIONS[register_grouped_attention("sdpa")]
    out, _ = fn(_Layer(torch.bfloat16), q, k, v.to(torch.bfloat16), None, scaling=0.3, **{LAYOUT_KWARG: layout})
    assert out.dtype == torch.bfloat16
    ref = _dense_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout)
    torch.testing.assert_close(out.double(), ref, atol=0.02, rtol=0.02)  # bf16 rounding, as above


def test_fp32_model_under_bf16_autocast(load_tiny, fake_flash):
    """The whole tiny model with fp32 weights under CPU bf16 autocast: "auto" is resolved for bf16 (where CUDA would
    take flash, not the slow masked path), and the explicit flash backend (stand-in, fp32 refused) runs and agrees
    with the repeated forward under the same autocast within bf16 rounding."""
    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", [(4, 56, 84), None], "left")
    ids, mask = completions([2, 1], [3, 1, 4], model.config.text_config.vocab_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(model, torch.device("cpu")) == torch.bfloat16
        g = grouped_logprobs(model, inputs, ids, mask, [2, 1], backend="flash")
        r = repeated_logprobs(model, inputs, ids, mask, [2, 1])
    diff = float(((g - r).abs() * mask).max())
    print(f"fp32 weights, bf16 autocast, flash (stand-in) vs repeated: max logprob diff {diff:.3g}")
    assert diff <= 0.02
    assert compute_dtype(model, torch.device("cpu")) == torch.float32


# ---- finding 10: layout tensors on each layer's device -------------------------------------------------------------

def test_layout_follows_the_layer_device():
    """A layout built for one device (here "meta", standing in for the embedding's GPU) handed to a layer on another
    (here the CPU) runs on a copy on the layer's device, built once; results equal a layout built there."""
    meta = GroupLayout(*LAYOUT, torch.device("meta"), backend="sdpa")
    cpu = meta.for_device(torch.device("cpu"))
    assert cpu is meta.for_device("cpu") and cpu.prefix_index.device.type == "cpu"
    assert meta.for_device(torch.device("meta")) is meta
    q, k, v = _qkv(meta.total)
    fn = ALL_ATTENTION_FUNCTIONS[register_grouped_attention("sdpa")]
    for backend in ("sdpa", "lse_reference"):
        meta.backend = backend
        meta.__dict__.pop("_per_device")
        out, _ = fn(_Layer(), q, k, v, None, scaling=0.3, **{LAYOUT_KWARG: meta})
        assert out.device.type == "cpu"
        ref = _dense_reference(q, k, v, meta.for_device("cpu"))
        assert float((out - ref).abs().max()) <= 1e-12


# ---- finding 7: the masked SDPA path with and without the GQA copy ---------------------------------------------------

@pytest.mark.parametrize("expand", [True, False], ids=["expand_kv_heads", "enable_gqa"])
def test_masked_sdpa_path_is_exact_either_way(expand, monkeypatch):
    from mmpg.grouping.backends import sdpa

    monkeypatch.setattr(sdpa, "MASKED_EXPAND_KV_HEADS", expand)
    layout = GroupLayout(*LAYOUT, torch.device("cpu"))
    q, k, v = (x.requires_grad_() for x in _qkv(layout.total))
    out = sdpa.sdpa_grouped_attention(q, k, v, layout, 0.3, path="masked")
    ref = _dense_reference(q, k, v, layout)
    assert float((out - ref).detach().abs().max()) <= 1e-12
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert float((a - b).abs().max()) <= 1e-12


# ---- finding 8: create_block_mask compiled as torch 2.14 documents ---------------------------------------------------

def test_block_mask_is_built_without_the_deprecated_compile_flag(monkeypatch):
    """Fast check of the call: `torch.compile(create_block_mask)`, no `_compile=True` (a DeprecationWarning per
    layout in torch 2.14). The compile itself is replaced by the plain function here; the slow test compiles."""
    from torch.nn.attention import flex_attention

    from mmpg.grouping.backends import flex

    seen = []

    def fake_compile(fn, **kwargs):
        seen.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    flex._compiled_create_block_mask.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            mask = flex.block_mask(GroupLayout(*LAYOUT, torch.device("cpu")))
    finally:
        flex._compiled_create_block_mask.cache_clear()
    assert seen == [flex_attention.create_block_mask]
    assert mask.shape[-2:] == (flex.bucket_length(sum(LAYOUT[0]) + sum(map(sum, LAYOUT[1]))),) * 2  # padded


@pytest.mark.slow
def test_compiled_block_mask_matches_the_rule():
    """The real compile (about 20 s on 2 CPU cores), no deprecation warning, and the blocks it keeps are exactly the
    blocks where the layout's rule allows some attention."""
    from mmpg.grouping.backends.flex import block_mask

    layout = GroupLayout([37, 5, 130], [[1, 4, 2], [3], [2, 2, 6, 1]], torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        mask = block_mask(layout)
    from mmpg.grouping.backends.flex import _labels, bucket_length

    size, padded = mask.BLOCK_SIZE[0], bucket_length(layout.total)
    group, resp = _labels(layout, padded)  # the layout's rule, the padding a causal group of its own
    i = torch.arange(padded)
    dense = (group[None, :] == group[:, None]) & (i[None, :] <= i[:, None]) & \
        ((resp[None, :] == -1) | (resp[None, :] == resp[:, None]))
    assert torch.equal(dense[:layout.total, :layout.total], layout.dense_mask())
    n = padded // size
    expected = dense.view(n, size, n, size).any(dim=(1, 3))
    assert torch.equal(mask.to_dense()[0, 0].bool(), expected)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # on purpose, below
@pytest.mark.parametrize("name", [b for b in BACKENDS if b != "auto"])
def test_every_backend_name_computes_the_layouts_rule(name, fake_flash, monkeypatch):
    """Each name the `grouping.backend` setting accepts maps to a backend whose output is the dense rule's (float32,
    within 1e-5: float32 roundoff over rows of at most 16 keys at values about 1); flash on the stand-in kernel,
    allowed float32 here; flex uncompiled (its compiled kernel: tests/test_grouping_flex.py). An unknown name is
    refused naming the choices."""
    from mmpg.grouping.backends import flex

    fake_flash.ALLOW_FP32 = True
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    caches = (flex._compiled_flex, flex._compiled_create_block_mask)
    layout = GroupLayout(*LAYOUT, torch.device("cpu"), backend=name)
    q, k, v = _qkv(layout.total, torch.float32)
    for cached in caches:
        cached.cache_clear()
    try:
        with torch.no_grad():
            out = get_backend(name)(q, k, v, layout, 0.3)
    finally:
        for cached in caches:
            cached.cache_clear()  # no uncompiled function left for later tests
    diff = float((out.double() - _dense_reference(q, k, v, layout)).abs().max())
    assert diff <= 1e-5, f"{name} differs from the dense rule by {diff:.3g}"
    with pytest.raises(ValueError, match="unknown grouped attention backend 'flash2'; choose sdpa, flash, flex or "
                                         "lse_reference"):
        get_backend("flash2")
