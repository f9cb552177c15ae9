"""GPU backends (`flash`, `flex`) against the repeated forward, on CUDA. Skipped without a CUDA device; run by
scripts/gpu_check.sh on a GPU machine. fp32: same bounds as the CPU tests; bf16: measured differences are printed
and bounded loosely (bf16 rounds differently along the two paths)."""

from __future__ import annotations

import pytest
import torch

from batches import completions, text_batch, vl_batch
from grouping_check import compare

pytestmark = pytest.mark.gpu

BF16_LOGP = 0.05
BF16_GRAD = 0.05


def _on_cuda(model, inputs, dtype):
    model = model.to("cuda", dtype=dtype)
    moved = {k: (v.to("cuda") if torch.is_tensor(v) else v) for k, v in inputs.items()}
    for key in ("pixel_values_videos", "pixel_values"):
        if key in moved:
            moved[key] = moved[key].to(dtype)
    return model, moved


def _needs(backend, dtype):
    if backend == "flash":
        pytest.importorskip("flash_attn")
        if dtype == torch.float32:
            pytest.skip("flash-attn has no fp32 kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["flash", "flex"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_gpu_backend_vl(family, backend, dtype, load_tiny):
    _needs(backend, dtype)
    model, processor = load_tiny(family)
    inputs = vl_batch(processor, family, [(8, 56, 84), None, (4, 112, 56)], "left")
    model, inputs = _on_cuda(model, inputs, dtype)
    group_sizes, lengths = [1, 3, 8], [4, 1, 7, 2, 5, 3, 8, 1, 6, 2, 9, 4]
    ids, mask = completions(group_sizes, lengths, model.config.text_config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()
    bounds = {} if dtype == torch.float32 else {"atol": BF16_LOGP, "rtol": BF16_GRAD}
    logp, grad, _ = compare(model, inputs, ids, mask, group_sizes, backend=backend, **bounds)
    print(f"{family} {backend} {dtype}: max logprob diff {logp:.3g}, worst relative grad diff {grad:.3g}")


@pytest.mark.parametrize("backend", ["flash", "flex", "sdpa"])
def test_gpu_backend_text(backend, load_tiny):
    _needs(backend, torch.bfloat16)
    model, tokenizer = load_tiny("qwen3")
    inputs = text_batch(tokenizer, 3)
    model, inputs = _on_cuda(model, inputs, torch.bfloat16)
    group_sizes, lengths = [2, 1, 4], [3, 1, 8, 2, 5, 6, 1]
    ids, mask = completions(group_sizes, lengths, model.config.vocab_size)
    logp, grad, _ = compare(model, inputs, ids.cuda(), mask.cuda(), group_sizes, backend=backend,
                            atol=BF16_LOGP, rtol=BF16_GRAD)
    print(f"qwen3 {backend} bf16: max logprob diff {logp:.3g}, worst relative grad diff {grad:.3g}")
