"""`perf/peak_memory_mb`: what a training run measures, on either device the same thing `mmpg plan` predicts.

    GPU  torch.cuda.max_memory_allocated: the high-water of the live tensors, what the plan counts.
    CPU  torch keeps no count of its CPU tensors, so the process's memory stands in for it, measured as
         `mmpg.plan.validate` measured the plan's CPU peaks (the resident set's high-water above a baseline):
             peak = max over the run of  VmHWM - RssFile - (RssAnon + RssShmem)(baseline) - imports
         The baseline is taken when the session starts, before the model is loaded (torch, transformers and
         DeepSpeed imported, the process group up). Left out, because they are code and not the run's data:
         RssFile, the file-backed pages (the code of torch, decord and the kernels a first step faults in: ~100 MB
         on a tiny model's first step), and `imports`, what each module imported after the baseline added to the
         anonymous memory (DeepSpeed's ZeRO-2 set-up alone imports ~680 modules, torch._inductor and networkx among
         them: ~55 MB). The high-water is reset after each such import (/proc/self/clear_refs), so a peak before an
         import is kept whole and one after it is counted without it. What remains: the tensors (weights,
         reference, optimizer states, the step's activations, the batch), the Python objects of the run's data and
         the allocator's slack. RssFile only grows, so a peak is at most the anonymous one (exact when no code was
         paged in after it).

The allocator's slack: glibc's mmap threshold starts at 128 KiB and rises to the size of each mapped block freed
(up to 32 MiB); blocks below it come from the heap and stay there once freed, where a later high-water counts them
(+30 % over the live tensors on a small model's first step, P 8k, G 16). A CPU run therefore fixes the threshold at
MMAP_THRESHOLD (mallopt M_MMAP_THRESHOLD): blocks of 1 MiB and more get a mapping of their own, returned when freed.
The cost is within the noise of a demo step (CPU seconds per step: 0.40-0.47 by default, 0.44 at 1 MiB; 64 KiB, the
validation's setting, costs 40 %). A MALLOC_MMAP_THRESHOLD_ in the environment is left as the user set it.

Where /proc/self/clear_refs cannot be written, the process's ru_maxrss (which cannot be reset) stands for VmHWM and
imports are subtracted whole (a lower bound); without /proc (not Linux) the figure is the whole process's
ru_maxrss, and `start`'s record says which.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import threading

MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
CUDA, CPU_ABOVE_BASELINE, WHOLE_PROCESS = "cuda.max_memory_allocated", "cpu.rss_above_baseline", "cpu.ru_maxrss"
# the CPU baseline of this process: {"held": anonymous + shared bytes at the baseline, "resettable": bool,
# "imports": bytes imports added since, "best": the largest figure of the segments closed so far}
_base: dict | None = None


def _status() -> dict[str, int]:
    """VmHWM, RssAnon, RssFile, RssShmem of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _anon() -> int:
    """Resident bytes not backed by a file or shared memory, from /proc/self/statm (resident - shared pages)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def _reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _settle() -> float:
    """Fold the high-water since the last reset into _base["best"] (bytes) and return it."""
    now = _status()
    high = now["VmHWM"] if _base["resettable"] else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _base["best"] = max(_base["best"], high - now["RssFile"] - _base["held"] - _base["imports"])
    return _base["best"]


def _count_imports() -> None:
    """Leave each module import of the main thread out of the figure (the outermost import only: its nested ones
    are inside it), by wrapping importlib's `_find_and_load`, through which every import of a module not yet
    loaded passes (the `import` statement's C path looks it up by name each time). Idempotent; where the name is
    missing (another Python), imports stay counted as the run's."""
    import importlib._bootstrap as bootstrap

    real = getattr(bootstrap, "_find_and_load", None)
    if real is None or getattr(real, "_mmpg_counted", False):
        return
    main, depth = threading.main_thread(), [0]

    def counted(*args, **kwargs):
        if depth[0] or threading.current_thread() is not main or _base is None:
            return real(*args, **kwargs)
        depth[0] += 1
        try:
            _settle()  # the peak so far, whole
            before = _anon()
        except Exception:  # noqa: BLE001 - the bookkeeping never fails an import (e.g. at interpreter exit)
            before = None
        try:
            return real(*args, **kwargs)
        finally:
            depth[0] -= 1
            if before is not None:
                try:
                    _base["imports"] += max(_anon() - before, 0)
                    if _base["resettable"]:
                        _reset_high_water()  # the next peak is measured from here, the import's memory left out
                except Exception:  # noqa: BLE001 - as above
                    pass

    counted._mmpg_counted = True
    bootstrap._find_and_load = counted


def start(device: str) -> dict:
    """Take this process's baseline (CPU; call before the model is loaded) and return the record of what
    perf/peak_memory_mb measures (run.json's "peak_memory": {"measure", and on the CPU "baseline_mb",
    "high_water", "mmap_threshold"})."""
    global _base
    if device == "cuda":
        return {"measure": CUDA}
    import deepspeed  # noqa: F401 - the engine's library: imported now, its modules are in the baseline

    libc = _libc()
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if libc is not None and threshold is None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        threshold = str(MMAP_THRESHOLD)
    gc.collect()
    if libc is not None:
        libc.malloc_trim(0)  # free pages the allocator kept from the imports: not the run's
    try:
        now = _status()
    except (OSError, ValueError):
        _base = None
        return {"measure": WHOLE_PROCESS}
    resettable = _reset_high_water()
    held = now["RssAnon"] + now.get("RssShmem", 0)
    _base = {"held": held, "resettable": resettable, "imports": 0, "best": 0}
    _count_imports()
    return {"measure": CPU_ABOVE_BASELINE, "baseline_mb": round((held + now["RssFile"]) / 2 ** 20, 1),
            "high_water": "VmHWM" if resettable else "ru_maxrss",
            "mmap_threshold": int(threshold) if threshold and threshold.isdigit() else None}


def peak_memory_mb(device: str) -> float:
    """The run's peak so far, in MiB (module docstring): the GPU's tensors, or the CPU's memory above the baseline
    (the whole process's ru_maxrss where `start` took none)."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2 ** 20
    if _base is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return max(_settle(), 0) / 2 ** 20
