"""The flex backend's length buckets (`mmpg.grouping.backends.flex`): the bucket rule, the padding's exactness against
the dense-mask reference, and the compile count across packed lengths that share a bucket."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from mmpg.grouping import GroupLayout
from mmpg.grouping.backends import flex
from mmpg.grouping.backends.flex import BLOCK, bucket_length


def _dense_reference(q, k, v, layout, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask(), scale=scale).transpose(1, 2)


def _qkv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, T, 8, generator=g) for h in (4, 2, 2)]


def test_bucket_rule():
    assert [bucket_length(t) for t in (1, 128, 129, 256, 257, 300, 1000, 1025, 5000, 70000)] == \
        [128, 128, 256, 256, 384, 384, 1024, 1280, 5120, 81920]
    seen = set()
    for t in range(1, 131073):
        b = bucket_length(t)
        assert b >= t and b % BLOCK == 0, t
        assert b - t < BLOCK if t <= 1024 else b <= 1.25 * t, t  # the waste the docstring promises
        seen.add(b)
    assert len(seen) == 8 + 4 * 7  # 128..1024 in steps of 128, then four buckets per doubling up to 2^17
    with pytest.raises(ValueError, match="packed length 0"):
        bucket_length(0)


@pytest.mark.parametrize("lens", [([17, 9], [[3, 5, 1], [4, 4]]), ([130, 40], [[1, 30, 2], [7]])])
def test_padded_flex_matches_the_dense_rule(lens):
    """The row padded to its bucket (47 -> 128, 210 -> 256 tokens): the real tokens' output is the unpadded
    attention's, within float32 roundoff."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    layout = GroupLayout(*lens, torch.device("cpu"), backend="flex")
    assert bucket_length(layout.total) > layout.total
    q, k, v = _qkv(layout.total)
    with torch.no_grad():
        out = flex.flex_grouped_attention(q, k, v, layout, 0.3)
    ref = _dense_reference(q, k, v, layout, 0.3)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-5), float((out - ref).abs().max())


@pytest.mark.slow
def test_lengths_in_one_bucket_compile_once_more_at_most(caplog):
    """Six packed lengths in the 384 bucket after a warm-up: no new compile, no new bucket; the counter and the info
    line report what compiled (about 20 s on 2 CPU cores)."""
    pytest.importorskip("torch.nn.attention.flex_attention")

    def run(prefix):
        layout = GroupLayout([prefix], [[3, 4]], torch.device("cpu"), backend="flex")
        with torch.no_grad():
            flex.flex_grouped_attention(*_qkv(layout.total), layout, 0.25)

    with caplog.at_level(logging.INFO, logger="mmpg.grouping"):
        run(300), run(310)  # a static graph, then the dynamic one
        warm = flex.compile_stats()
        assert warm["compiles"] >= 1 and 384 in warm["buckets"]
        assert any("flex: compiled for packed length" in r.getMessage() for r in caplog.records)
        for prefix in (290, 320, 333, 350, 360, 370):
            run(prefix)
    assert flex.compile_stats() == warm
