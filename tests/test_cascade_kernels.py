"""The cascade kernels' CPU-testable parts: the memory-efficient kernel's key bias (issue 30, defect 3).

`_cuda_efficient` runs torch's CUDA-only `_scaled_dot_product_efficient_attention`; here that op is replaced by a
stand-in that records the bias it is handed and answers with the math kernel, so the bias's shape, strides and storage
are checked on the CPU. The kernel itself is tests/test_cascade_gpu.py (gpu marker)."""

from __future__ import annotations

import torch

from mmpg.rollout import cascade_kernels
from mmpg.rollout.cascade_kernels import attend, key_bias


def _mask(lk=300, starts=(0, 17, 250)):
    return torch.arange(lk)[None, :] >= torch.tensor(starts)[:, None]  # [B, Lk], left padding


def test_key_bias_is_one_broadcast_row_per_batch_row():
    mask = _mask()
    bias = key_bias(mask, torch.bfloat16, heads=4, lq=56)
    assert bias.shape == (3, 4, 56, 300) and bias.dtype == torch.bfloat16
    assert bias.stride()[1:] == (0, 0, 1) and bias.stride(0) % 16 == 0  # aligned rows, broadcast over H and Lq
    assert bias.untyped_storage().nbytes() == 3 * 304 * 2  # B x ceil16(Lk) x 2 bytes, not x H x Lq
    expected = torch.zeros(3, 300).masked_fill(~mask, float("-inf"))
    assert torch.equal(bias.float(), expected[:, None, None, :].expand(3, 4, 56, 300))


def test_efficient_kernel_gets_the_broadcast_bias(monkeypatch):
    """The call site: the bias handed to the (stand-in) kernel holds B·ceil16(Lk) values, and the result is the math
    kernel's. Before the fix the bias was materialised [B, H, Lq, ceil16(Lk)] in every layer at every step."""
    seen = []

    def standin(q, k, v, bias, compute_lse, dropout, causal, scale=None):
        seen.append(bias)
        out, lse = attend(q, k, v, None if bias is None else bias[:, 0, 0] == 0, scale, "math")
        pad = (q.shape[2] + 31) // 32 * 32  # the kernel's LSE is padded along Lq to 32
        return out, torch.nn.functional.pad(lse, (0, pad - q.shape[2])), None, None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", standin)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 16, generator=g) for n in (20, 300, 300))
    mask = _mask()
    out, lse = cascade_kernels._cuda_efficient(q, k, v, mask, 0.25)
    ref, ref_lse = attend(q, k, v, mask, 0.25, "math")
    assert seen[0].untyped_storage().nbytes() == 3 * 304 * 4
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-6)
