"""Memory probes of the bench: the peak extra memory of a stretch of work, CPU or GPU.

Peak = high-water during the work − memory in use right before it:
    CPU  resident set size: VmHWM after `echo 5 > /proc/self/clear_refs` (resets the high-water), minus the RSS
         before; where clear_refs is not writable, `ru_maxrss` (the process high-water, which cannot be reset)
         minus the RSS before, and only when the work raised it: otherwise its peak is hidden under an earlier one.
    GPU  `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, minus `memory_allocated()` before.
A CPU peak that is not above the memory in use before is None (shown as n/a), not 0: the work ran in pages the
process already held. `measured` measures one body (the worker's cold step); `mmpg.bench.step.PhaseClock` resets the
high-water per phase and counts each from the step's start (`in_use`, `reset_peak`, `peak_since`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import types

import torch

CLEAR_REFS, MAXRSS, CUDA = "VmHWM-after-clear_refs", "ru_maxrss", "cuda.max_memory_allocated"  # the mem_method


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_hwm() -> bool:
    """The high-water mark restarted from now (`mmpg.train.peak_memory.reset_high_water`, the run's own probe)."""
    from mmpg.train.peak_memory import reset_high_water

    return reset_high_water()


def hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_env(case: dict) -> dict:
    """The environment of a worker process for the case. With `mmap_threshold` (bytes), glibc gives every block of
    at least that size its own mapping (MALLOC_MMAP_THRESHOLD_), unmapped when freed, so the CPU RSS follows the live
    tensors: by default glibc raises that threshold up to 32 MiB as blocks are freed and keeps freed blocks below it
    in its heap, where a later RSS high-water counts them (measured: ~300 MB per rank at the end of the sp 2
    grouped forward at P 16K, `mmpg.bench.sp`)."""
    env = dict(os.environ)
    if case.get("mmap_threshold"):
        env["MALLOC_MMAP_THRESHOLD_"] = str(int(case["mmap_threshold"]))
    return env


def release(device: torch.device) -> bool:
    """Give freed memory back before a measured stretch: `gc.collect()` and, on the CPU, glibc's `malloc_trim(0)`,
    which returns the free pages the allocator kept from earlier work (freed tensors stay in the RSS otherwise, so
    a later phase's RSS high-water would count an earlier phase's garbage). False where there is no glibc."""
    gc.collect()
    if device.type == "cuda":
        return True
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def in_use(device: torch.device) -> int:
    """The memory in use now: bytes allocated on the GPU, the RSS on the CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else rss()


def reset_peak(device: torch.device) -> tuple[str, int | None]:
    """Reset the high-water mark: (method, the process high-water now where it cannot be reset, else None)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return CUDA, None
    if reset_hwm():
        return CLEAR_REFS, None
    return MAXRSS, maxrss()


def peak_since(device: torch.device, base: int, before: int | None) -> int | None:
    """The high-water since `reset_peak` (which returned `before`) minus `base`; None where it cannot be seen."""
    if device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(device) - base, 0)  # exact: 0 is 0
    if before is not None:  # ru_maxrss: seen only when the work raised the process high-water
        high = maxrss()
        return high - base if high > before else None
    grown = hwm() - base
    return grown if grown > 0 else None


@contextlib.contextmanager
def measured(device: torch.device):
    """The peak extra memory of the body: yields a namespace whose `peak` (None where it could not be seen) and
    `method` hold after the body."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
    mem = types.SimpleNamespace(base=in_use(device), peak=None)
    mem.method, before = reset_peak(device)
    yield mem
    sync(device)
    mem.peak = peak_since(device, mem.base, before)
