"""Which SDPA kernels the sdpa backend's masked path runs (`mmpg.grouping.backends.sdpa._masked_responses`: a group's
responses against [prefix | responses] with a bool mask, the path off the CPU), with the GQA K/V heads copied
(`MASKED_EXPAND_KV_HEADS = True`, the default) and with `enable_gqa=True` instead. A program, never a test:

    python -m mmpg.bench.sdpa_kernels                     on CUDA when there is one (bf16), else the CPU (float32)
    python -m mmpg.bench.sdpa_kernels --out kernels.json  also writes the rows as JSON

One row per setting: the profiler's attention, softmax and matmul kernel names, the time of the one profiled call
(profiler overhead included: a rough figure) and the max |difference| from the dense rule in float64. Flip MASKED_EXPAND_KV_HEADS when the enable_gqa row shows the
memory-efficient kernel (no K/V copy). Exactness of both settings is tested (tests/test_gpu_paths_on_cpu.py on the
CPU, tests/test_grouping_gpu.py on CUDA); this only says which kernel runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mmpg.grouping import GroupLayout
from mmpg.grouping.backends import sdpa

# two prompts (512 and 300 tokens), unequal responses; 8 query heads, 2 key-value heads (GQA 4), head_dim 64
LAYOUT = ([512, 300], [[64, 32, 128], [16, 200]])
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
KERNEL_WORDS = ("attention", "fmha", "softmax", "gemm")


def _dense(q, k, v, layout, scale) -> torch.Tensor:
    """[1, T, Hq, D] float64: attention under the layout's rule."""
    rep = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(rep, 1).transpose(-1, -2) * scale
    s = s.masked_fill(~layout.dense_mask(), float("-inf"))
    return (s.softmax(-1) @ v.double().repeat_interleave(rep, 1)).transpose(1, 2)


def masked_path_kernels(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per MASKED_EXPAND_KV_HEADS setting: {setting, kernels, ms, max_abs_vs_dense}."""
    from torch.profiler import ProfilerActivity, profile

    layout = GroupLayout(*LAYOUT, device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, h, layout.total, HEAD_DIM, generator=g, device=device, dtype=dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    scale = HEAD_DIM ** -0.5
    ref = _dense(q, k, v, layout, scale)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    default, rows = sdpa.MASKED_EXPAND_KV_HEADS, []
    for expand in (True, False):
        sdpa.MASKED_EXPAND_KV_HEADS = expand
        try:
            sdpa.sdpa_grouped_attention(q, k, v, layout, scale, path="masked")  # warm-up
            with profile(activities=[activity]) as prof:
                start = time.perf_counter()
                out = sdpa.sdpa_grouped_attention(q, k, v, layout, scale, path="masked")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                ms = 1e3 * (time.perf_counter() - start)
        finally:
            sdpa.MASKED_EXPAND_KV_HEADS = default
        names = sorted({e.key for e in prof.key_averages() if any(w in e.key.lower() for w in KERNEL_WORDS)})
        rows.append({"setting": "expand_kv_heads" if expand else "enable_gqa", "kernels": names, "ms": ms,
                     "max_abs_vs_dense": float((out.double() - ref).abs().max())})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmpg.bench.sdpa_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = masked_path_kernels(device, dtype)
    print(f"sdpa masked path, {device.type} {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, "
          f"layout {LAYOUT}, heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}")
    print(f"{'setting':<16} {'ms, profiled':>12} {'max|d| vs dense':>16}  kernels")
    for r in rows:
        print(f"{r['setting']:<16} {r['ms']:>12.2f} {r['max_abs_vs_dense']:>16.3g}  {', '.join(r['kernels'])}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": device.type, "dtype": str(dtype), "torch": torch.__version__,
                                        "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
