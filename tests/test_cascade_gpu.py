"""Cascade decoding's CUDA kernels (`sdpa`: torch's memory-efficient kernel with its LSE; `flash`: flash-attn's
`flash_attn_with_kvcache` with `cache_leftpad` and its LSE) against the float32 `math` kernel, and the cascade engine
on CUDA against the copy path, at tiny and at the released head geometry (tests/release_geometry.py). Skipped without a
CUDA device; UNTESTED on a GPU so far.

fp32: the same bounds as the CPU tests (token-identical greedy decoding, logprobs within 1e-4 of the grouped
recompute). bf16: the two paths round differently, so differences are printed and bounded loosely."""

from __future__ import annotations

import pytest
import torch

from batches import assert_recompute_matches, vl_batch
from release_geometry import compare_cascade
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout.cascade_kernels import attend

pytestmark = pytest.mark.gpu

VIDEOS = [(4, 56, 84), None, (6, 56, 112)]
SIZES = [2, 1, 3]


def _needs(backend, dtype):
    if backend == "flash":
        pytest.importorskip("flash_attn")
        if dtype == torch.float32:
            pytest.skip("flash-attn has no fp32 kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
def test_cuda_kernel_matches_math(backend, dtype, padded, record_property):
    _needs(backend, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Lq, Lk, D = 3, 2, 16, 300, 64  # Lq = G_max * rep of a prefix block; Lk not a multiple of 16
    q, k, v = (torch.randn(B, H, n, D, generator=g, device="cuda", dtype=dtype) for n in (Lq, Lk, Lk))
    mask = None
    if padded:
        mask = torch.arange(Lk, device="cuda")[None, :] >= torch.tensor([0, 17, 250], device="cuda")[:, None]
    out, lse = attend(q, k, v, mask, 0.125, backend)
    ref, ref_lse = attend(q.float(), k.float(), v.float(), mask, 0.125, "math")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    print(f"{backend} {dtype}: out {float((out.float() - ref).abs().max()):.2e}, "
          f"lse {float((lse - ref_lse).abs().max()):.2e}")
    record_property("max_abs_out", float((out.float() - ref).abs().max()))
    record_property("max_abs_lse", float((lse - ref_lse).abs().max()))
    assert out.shape == q.shape and lse.shape == (B, H, Lq) and lse.dtype == torch.float32
    assert float((out.float() - ref).abs().max()) < tol and float((lse - ref_lse).abs().max()) < tol


def test_cuda_efficient_bias_is_broadcast(record_property):
    """Issue 30, defect 3: the memory-efficient kernel takes the broadcast key bias (`key_bias`) and allocates
    about B·ceil16(Lk) bytes of it per call, not the B·H·Lq·Lk of a materialised bias; same result as math."""
    B, H, Lq, Lk, D = 2, 4, 56, 16_000, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g, device="cuda", dtype=torch.bfloat16) for n in (Lq, Lk, Lk))
    mask = torch.arange(Lk, device="cuda")[None, :] >= torch.tensor([0, 999], device="cuda")[:, None]
    attend(q, k, v, mask, D ** -0.5, "sdpa")  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, lse = attend(q, k, v, mask, D ** -0.5, "sdpa")
    extra = torch.cuda.max_memory_allocated() - before - out.numel() * 2 - lse.numel() * 4
    record_property("extra_bytes", extra)
    assert extra < B * H * Lq * Lk * 2 // 4, f"{extra} bytes beyond the outputs: the bias was materialised"
    ref, ref_lse = attend(q.float(), k.float(), v.float(), mask, D ** -0.5, "math")
    assert float((out.float() - ref).abs().max()) < 2e-2 and float((lse - ref_lse).abs().max()) < 2e-2


@pytest.mark.parametrize("geometry", ["gqa7", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
def test_cuda_kernel_release_geometry(backend, dtype, padded, geometry, record_property):
    """The released head geometry (head_dim 128; 4 or 8 key-value heads with 16 rows x GQA 7 or 4 folded into the
    query length, tests/release_geometry.py) against the float32 math kernel, same bounds as above."""
    _needs(backend, dtype)
    out, lse = compare_cascade(backend, geometry, dtype, "cuda", padded)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    record_property("max_abs_out", out)
    record_property("max_abs_lse", lse)
    print(f"{backend} {dtype} {geometry}: out {out:.2e}, lse {lse:.2e}")
    assert out < tol and lse < tol


def _on_cuda(model, inputs, dtype):
    model = model.to("cuda", dtype=dtype)
    moved = {k: (v.to("cuda") if torch.is_tensor(v) else v) for k, v in inputs.items()}
    if "pixel_values_videos" in moved:
        moved["pixel_values_videos"] = moved["pixel_values_videos"].to(dtype)
    return model, moved


@pytest.mark.parametrize("backend", ["math", "sdpa"])  # sdpa: what "auto" takes on CUDA without flash-attn
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_cuda_cascade_equals_copy_fp32(family, backend, load_tiny):
    model, processor = load_tiny(family)
    model, inputs = _on_cuda(model, vl_batch(processor, family, VIDEOS), torch.float32)
    greedy = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=())
    copy = HFEngine(model, processor, decode="copy").generate_groups(inputs, SIZES, greedy)
    cascade = HFEngine(model, processor, decode="cascade", cascade_backend=backend).generate_groups(
        inputs, SIZES, greedy)
    assert torch.equal(copy.completion_ids, cascade.completion_ids)
    assert_recompute_matches(model, inputs, cascade, 1.0, 1e-4)


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
def test_cuda_cascade_bf16(backend, load_tiny):
    _needs(backend, torch.bfloat16)
    model, processor = load_tiny("qwen2_5_vl")
    model, inputs = _on_cuda(model, vl_batch(processor, "qwen2_5_vl", VIDEOS), torch.bfloat16)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, seed=0, stop_token_ids=())
    rollout = HFEngine(model, processor, decode="cascade", cascade_backend=backend).generate_groups(
        inputs, SIZES, sampling, prompt_seeds=[1, 2, 3])
    assert rollout.completion_ids.shape == (sum(SIZES), 10)
    assert_recompute_matches(model, inputs, rollout, 1.0, 0.05)


def test_cuda_decode_check_keeps_the_fastest_kernel(load_tiny):
    """On CUDA `decode="auto"` is cascade with flash (when usable) or sdpa, checked against copy decoding on the
    first batch (bf16); the fastest kernel must pass and stay recorded without a step-down."""
    from mmpg import choices

    choices.reset()
    model, processor = load_tiny("qwen2_5_vl")
    model, inputs = _on_cuda(model, vl_batch(processor, "qwen2_5_vl", VIDEOS), torch.bfloat16)
    engine = HFEngine(model, processor)
    engine.generate_groups(inputs, SIZES, SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=()))
    chosen = choices.current()["decode_kernel"]
    print(f"decode kernel: {chosen}")
    assert chosen["value"] == engine.choice.chain[0] and chosen["value"] in ("flash", "sdpa"), chosen
    assert chosen["why"] == "", chosen["why"]
