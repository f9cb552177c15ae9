"""The log-sum-exp merge (`mmpg.grouping.merge`) against one softmax over the concatenated keys."""

import torch

from mmpg.grouping.backends.varlen import TorchVarlenKernel
from mmpg.grouping.merge import merge_attention


def _attention(q, k, v, scale, key_mask=None):
    """q [B, H, Lq, D], k/v [B, H, Lk, D], key_mask [B, 1, 1, Lk] -> (o, lse), dense softmax in float64."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double()), torch.logsumexp(s, dim=-1)


def test_three_parts_with_an_empty_one_equal_one_softmax_over_all_keys():
    """Keys split 4 | 7 | 3; the third part has no key for batch row 1. As chunk_attention does, that part is
    computed on all its keys (a finite o) and its lse set to -inf: weight exactly 0."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 14, 8, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.ones(2, 1, 1, 14, dtype=torch.bool)
    keep[1, ..., 11:] = False  # row 1 sees none of part 3's keys
    ref_o, ref_lse = _attention(q, k, v, 0.3, keep)
    parts = [_attention(q, k[..., a:b, :], v[..., a:b, :], 0.3) for a, b in [(0, 4), (4, 11), (11, 14)]]
    o3, lse3 = parts[2]
    parts[2] = (o3, lse3.masked_fill(torch.tensor([False, True])[:, None, None], float("-inf")))
    assert torch.isfinite(parts[2][0]).all() and torch.isinf(parts[2][1][1]).all()
    o, lse = merge_attention(parts)
    assert o.dtype == lse.dtype == torch.float64 and o.shape == ref_o.shape and lse.shape == ref_lse.shape
    assert (o - ref_o).abs().max() < 1e-12, (o - ref_o).abs().max()
    assert (lse - ref_lse).abs().max() < 1e-12, (lse - ref_lse).abs().max()
    # the empty part changes nothing for row 1, to the last bit
    alone, _ = merge_attention([(x[1:], y[1:]) for x, y in parts[:2]])
    assert torch.equal(o[1:], alone)


def test_bf16_parts_are_accumulated_in_float32():
    """bf16 outputs, float32 LSEs -> bf16 output, float32 lse. Summed in float32, the result is the float64 merge
    rounded to bf16 (a bf16 sum misses it on most entries, by up to several ulp)."""
    g = torch.Generator().manual_seed(1)
    parts = [(torch.randn(4, 64, 32, generator=g).bfloat16(), torch.randn(4, 64, generator=g) * 3) for _ in range(3)]
    o, lse = merge_attention(parts)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    exact, exact_lse = merge_attention([(x.double(), y.double()) for x, y in parts])
    rounded = exact.bfloat16().double()
    diff = (o.double() - rounded).abs()
    assert (diff > 0).float().mean() < 0.01, (diff > 0).float().mean()
    assert (diff <= 2 ** -7 * rounded.abs()).all(), diff.max()  # at most one bf16 ulp anywhere
    assert (lse.double() - exact_lse).abs().max() < 1e-5


def test_out_dtype_and_transposed_lse_layout():
    """`dtype` sets the output's dtype; an LSE laid out [H, T] against o [T, H, D] (the varlen kernels') is passed
    as a transposed view, and the merged LSE comes back contiguous in that layout after one .t()."""
    g = torch.Generator().manual_seed(2)
    o_a, o_b = (torch.randn(6, 2, 4, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 6, generator=g) for _ in range(2))
    o, lse = merge_attention([(o_a, lse_a.t()), (o_b, lse_b.t())], torch.float64)
    assert o.dtype == torch.float64 and lse.t().is_contiguous() and lse.t().shape == (2, 6)
    w_a = torch.sigmoid(lse_a - lse_b).t()[..., None]  # e^a / (e^a + e^b)
    assert (o - (w_a * o_a + (1 - w_a) * o_b).double()).abs().max() < 1e-6


def test_lse_merge_is_attention_over_the_union():
    """The varlen reference kernel over keys 0..5 equals its two calls over 0..2 and 3..5, merged."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    kern = TorchVarlenKernel()
    cu6, cu3 = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    o_full, lse_full = kern.forward(q, k, v, cu6, cu6, 6, 6, False, 0.5)
    o_a, lse_a = kern.forward(q, k[:3], v[:3], cu6, cu3, 6, 3, False, 0.5)
    o_b, lse_b = kern.forward(q, k[3:], v[3:], cu6, cu3, 6, 3, False, 0.5)
    o, lse = merge_attention([(o_a, lse_a.t()), (o_b, lse_b.t())])
    assert torch.allclose(o, o_full, atol=1e-12) and torch.allclose(lse.t(), lse_full, atol=1e-12)
