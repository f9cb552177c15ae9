"""This machine's CPU as a plan's device: its memory (MemTotal) and a quick measure of its float32 matmul rate and
copy bandwidth (a few tenths of a second), for `mmpg plan --device cpu`."""

from __future__ import annotations

import time


def cpu_memory() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def cpu_throughput() -> tuple[float, float]:
    """(TFLOP/s of a float32 512x512 matmul, TB/s of a 64 MB copy), best of a few tries."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    src = torch.empty(16 * 2 ** 20)
    dst = torch.empty_like(src)
    best_mm = best_cp = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best_mm = min(best_mm, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        best_cp = min(best_cp, time.perf_counter() - t0)
    return 2 * 512 ** 3 / best_mm / 1e12, 2 * src.numel() * 4 / best_cp / 1e12
