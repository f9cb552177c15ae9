"""The `flash` backend's call sites run on the CPU through our stand-in flash_attn package (tests/fake_flash_attn):
flash-attn 2.8.3's varlen forward/backward signatures, argument checks and return layouts, with a plain-torch kernel.
Everything of the flash backend runs here except the CUDA kernel itself (tests/test_grouping_gpu.py has that).

Bounds: fp32 (the stand-in's ALLOW_FP32 test flag) is held to the project's fp32 bounds, 1e-5 on logprobs and 1e-4
relative on every gradient. bf16 (the dtype flash-attn really runs in): the grouped forward rounds along other paths
than the repeated one, so its bounds are set at about 4x the differences measured on these models (BF16_* below)."""

from __future__ import annotations

import pytest
import torch

from batches import completions, text_batch, vl_batch
from flash_standin import standin_flash_attn
from grouping_check import compare


@pytest.fixture
def fake_flash(monkeypatch):
    yield from standin_flash_attn(monkeypatch)


# Measured 2026-11-30 (CPU, 2 threads, stand-in kernel, the cases below), grouped flash vs repeated forward:
#   fp32: max |logprob diff| 4.8e-7 / 9.5e-7 / 4.8e-7, worst relative gradient diff 1.8e-6 / 1.7e-6 / 7.2e-7
#   bf16: max |logprob diff| 0.0020 / 0.0015 / 0.0020, worst relative gradient diff 0.033 / 0.029 / 0.014
# (qwen2_5_vl / qwen3_vl / qwen3). The grouped `sdpa` backend in bf16 differs from the repeated forward by the same
# 0.0020 / 0.033 on qwen2_5_vl: bf16 rounding of the model, not the flash path, sets these figures.
BF16_LOGP = 0.01
BF16_GRAD = 0.1

VIDEOS, GROUPS, LENGTHS = [(4, 84, 56), None, (6, 56, 112)], [1, 3, 8], [4, 1, 7, 2, 5, 3, 8, 1, 6, 2, 9, 4]


def _case(family, load_tiny, dtype):
    model, processor = load_tiny(family, dtype=dtype)
    if family in ("qwen2", "qwen3"):
        inputs = text_batch(processor, 3)
        groups, lengths, vocab = [2, 1, 4], [3, 1, 8, 2, 5, 6, 1], model.config.vocab_size
    else:
        inputs = vl_batch(processor, family, VIDEOS, "left")
        inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(dtype)
        groups, lengths, vocab = GROUPS, LENGTHS, model.config.text_config.vocab_size
    ids, mask = completions(groups, lengths, vocab)
    return model, inputs, ids, mask, groups


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3"])
def test_flash_backend_fp32_through_the_model(family, load_tiny, fake_flash):
    fake_flash.ALLOW_FP32 = True
    model, inputs, ids, mask, groups = _case(family, load_tiny, torch.float32)
    logp, grad, _ = compare(model, inputs, ids, mask, groups, backend="flash")
    print(f"{family} flash (stand-in) fp32: max logprob diff {logp:.3g}, worst relative grad diff {grad:.3g}")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3"])
def test_flash_backend_bf16_through_the_model(family, load_tiny, fake_flash):
    model, inputs, ids, mask, groups = _case(family, load_tiny, torch.bfloat16)
    logp, grad, _ = compare(model, inputs, ids, mask, groups, backend="flash", atol=BF16_LOGP, rtol=BF16_GRAD)
    print(f"{family} flash (stand-in) bf16: max logprob diff {logp:.3g}, worst relative grad diff {grad:.3g}")


# ---- the stand-in keeps flash-attn's argument checks, so the call sites are checked against them --------------------

def _qkv(dtype, total=7, hq=4, hk=2, d=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(total, h, d, generator=g).to(dtype) for h in (hq, hk, hk)]


def test_standin_refuses_what_flash_attn_refuses(fake_flash):
    fwd = fake_flash._flash_attn_varlen_forward
    q, k, v = _qkv(torch.bfloat16)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse, _, _ = fwd(q, k, v, cu, cu, 4, 4, 0.0, 0.25, True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (4, 7)  # [H, total_q]
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        fwd(*(x.float() for x in (q, k, v)), cu, cu, 4, 4, 0.0, 0.25, True)
    with pytest.raises(RuntimeError, match="same dtype"):
        fwd(q, k.half(), v, cu, cu, 4, 4, 0.0, 0.25, True)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        fwd(q, k, v, cu.long(), cu, 4, 4, 0.0, 0.25, True)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must be contiguous"):
        fwd(q, k, v, cu, torch.tensor([0, 0, 3, 3, 7, 7], dtype=torch.int32)[::2], 4, 4, 0.0, 0.25, True)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        fwd(q.transpose(0, 2).contiguous().transpose(0, 2), k, v, cu, cu, 4, 4, 0.0, 0.25, True)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        fwd(*_qkv(torch.bfloat16, d=12), cu, cu, 4, 4, 0.0, 0.25, True)


def test_standin_kernel_matches_dense_attention(fake_flash):
    """Forward and backward of the stand-in against torch's SDPA per segment (fp32 flag on), so the model-level
    results above rest on a correct kernel; an empty causal row gets LSE +inf and output 0, as flash-attn's."""
    fake_flash.ALLOW_FP32 = True
    import flash_attn

    q, k, v = (x.requires_grad_() for x in _qkv(torch.float32))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True)
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, enable_gqa=True).transpose(0, 1)
        for a, e in ((0, 3), (3, 7))])
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert float((out - ref).detach().abs().max()) <= 1e-6
    for a, b in zip(grads, ref_grads):
        assert float((a - b).abs().max()) <= 1e-5
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    o, lse, _, _ = fake_flash._flash_attn_varlen_forward(q[:3].detach(), k[:2].detach(), v[:2].detach(), cu_q, cu_k,
                                                         3, 2, 0.0, 0.25, True)
    assert torch.isinf(lse[:, 0]).all() and torch.equal(o[0], torch.zeros_like(o[0]))  # row 0 sees no key


def test_flash_backend_in_fp32_is_refused_with_a_clear_error(load_tiny, fake_flash):
    model, inputs, ids, mask, groups = _case("qwen3", load_tiny, torch.float32)
    from mmpg.grouping import grouped_logprobs

    with torch.no_grad(), pytest.raises(RuntimeError, match="fp16/bf16 on CUDA .*backend='sdpa'"):
        grouped_logprobs(model, inputs, ids, mask, groups, backend="flash")


# ---- findings 4 and 5: which flash-attn the backend accepts ----------------------------------------------------------

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_hopper(monkeypatch):
    """The probe's GPU facts for a compute capability 9.0 device, on a machine without one (its smoke call, a real
    kernel launch, is replaced: only the gpu tests run it)."""
    from mmpg.grouping.backends import probe

    monkeypatch.setattr(probe, "gpu_facts", lambda device: ("NVIDIA H200", (9, 0)))
    monkeypatch.setattr(probe, "_smoke_test", lambda device: None)
    probe.reset()
    yield probe
    probe.reset()


def test_auto_takes_flash_only_when_usable(fake_flash, fake_hopper, monkeypatch):
    from mmpg.grouping.backends import resolve_backend

    assert resolve_backend("auto", CUDA0, torch.bfloat16) == "flash"
    assert resolve_backend("auto", CUDA0, torch.float32) == "sdpa"  # flash-attn has no fp32 kernel
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "sdpa"
    monkeypatch.setattr(fake_hopper, "gpu_facts", lambda device: ("Tesla T4", (7, 5)))
    fake_hopper.reset()
    usable, reason = fake_hopper.flash_status(CUDA0)
    assert not usable and "compute capability >= 8.0" in reason


def test_flash_attn_older_than_2_7_is_refused(fake_flash, fake_hopper, monkeypatch):
    """2.6's _flash_attn_varlen_forward returns the padded q where 2.7+ returns the LSE: never merge with it."""
    import flash_attn

    from mmpg.grouping.backends import resolve_backend
    from mmpg.grouping.backends.varlen import FlashVarlenKernel

    monkeypatch.setattr(flash_attn, "__version__", "2.6.3")
    with pytest.raises(ImportError, match=r"needs flash-attn >= 2.7.*found 2.6.3"):
        FlashVarlenKernel()
    usable, reason = fake_hopper.flash_status(CUDA0)
    assert not usable and "2.6.3" in reason
    assert resolve_backend("auto", CUDA0, torch.bfloat16) == "sdpa"


def test_flash_attention_4_alone_falls_back_to_sdpa(tmp_path, monkeypatch, fake_hopper):
    """flash-attn-4 installs only flash_attn/cute (no flash_attn/__init__.py): `import flash_attn` succeeds as a
    namespace package, but there is no FlashAttention 2 interface. "auto" must take sdpa, explicit flash must say so."""
    import sys

    from mmpg.grouping.backends import resolve_backend
    from mmpg.grouping.backends.varlen import FlashVarlenKernel

    if "flash_attn" in sys.modules:
        pytest.skip("a flash_attn is already imported in this process")
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("def flash_attn_varlen_func(*a, **k): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import flash_attn

        assert getattr(flash_attn, "__file__", None) is None  # a namespace package, as with the real wheel
        usable, reason = fake_hopper.flash_status(CUDA0)
        assert not usable and "FlashAttention 4" in reason
        assert resolve_backend("auto", CUDA0, torch.bfloat16) == "sdpa"
        with pytest.raises(ImportError, match="namespace package"):
            FlashVarlenKernel()
    finally:
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]
