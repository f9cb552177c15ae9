"""The grouped backends and the cascade kernels at the released models' head geometry (head_dim 128, GQA 7 and 4),
on the CPU: the CPU side of the `gpu` cases in test_grouping_gpu.py / test_cascade_gpu.py (tests/release_geometry.py),
on a layout of the same structure a third as long. Bounds: float32 1e-5 against float64 (1e-4 on the GPU), bf16 2e-2
on both. flex is left to the GPU (its CPU compile takes ~20 s per shape)."""

from __future__ import annotations

import pytest
import torch

from flash_standin import standin_flash_attn
from release_geometry import SHORT_LAYOUT, compare_cascade, compare_grouped

FP32 = 1e-5  # max |out - dense| and relative gradient difference, float32 against float64
BF16 = 2e-2  # bf16: about 5 ulps at 1 (outputs and gradients are rounded once or twice per part, then merged)


@pytest.fixture
def fake_flash(monkeypatch):
    yield from standin_flash_attn(monkeypatch)


@pytest.mark.parametrize("geometry", ["gqa7", "gqa4"])
@pytest.mark.parametrize("backend,dtype", [("sdpa", torch.float32), ("sdpa:masked", torch.float32),
                                           ("lse_reference", torch.float32), ("sdpa", torch.bfloat16),
                                           ("flash", torch.bfloat16)],
                         ids=["sdpa-fp32", "sdpa_masked-fp32", "varlen_lse-fp32", "sdpa-bf16", "flash_standin-bf16"])
def test_grouped_backend_release_geometry_cpu(backend, dtype, geometry, fake_flash, record_property):
    out, rel = compare_grouped(backend, geometry, dtype, "cpu", SHORT_LAYOUT)
    bound = FP32 if dtype == torch.float32 else BF16
    record_property("max_abs_out", out)
    record_property("max_rel_grad", max(rel.values()))
    assert out <= bound, f"{backend} {geometry}: output differs by {out:.3g} from the dense rule"
    worst = max(rel, key=rel.get)
    assert rel[worst] <= bound, f"{backend} {geometry}: d{worst} differs by {rel[worst]:.3g} (relative)"


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "leftpad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", ["gqa7", "gqa4"])
def test_cascade_kernel_release_geometry_cpu(geometry, dtype, padded, record_property):
    out, lse = compare_cascade("sdpa", geometry, dtype, "cpu", padded, group=8, prefix=100)
    bound = FP32 if dtype == torch.float32 else BF16
    record_property("max_abs_out", out)
    record_property("max_abs_lse", lse)
    assert out <= bound and lse <= bound, f"cascade sdpa {geometry}: out {out:.3g}, lse {lse:.3g}"
