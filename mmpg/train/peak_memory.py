"""`perf/peak_memory_mb`: what a training run measures, on either device the same thing `mmpg plan` predicts
(the measurements behind it: docs/plan.md, "A run beside its plan").

    GPU  torch.cuda.max_memory_allocated: the high-water of the live tensors, what the plan counts.
    CPU  the resident set's high-water above a baseline, as `mmpg.plan.validate` measured the plan's CPU peaks:
             peak = max over the run of  VmHWM - code - (RssAnon + RssShmem)(baseline) - imports
         baseline: when the session starts, before the model is loaded (torch, transformers and DeepSpeed imported,
         the process group up); code = RssFile - weights, the file-backed pages other than those of mapped
         *.safetensors files (a float32 checkpoint loaded on the CPU keeps its tensors in the file's pages: they are
         the run's data); imports: what each module imported after the baseline added to the anonymous memory. The
         high-water is reset after each such import (/proc/self/clear_refs), so a peak before it is kept whole. Code
         pages only grow, so the figure is at most the peak without them (exact when none were paged in after it).

A CPU run fixes glibc's mmap threshold at MMAP_THRESHOLD, 1 MiB: blocks that size and larger get a mapping of their
own, returned when freed, at no cost to a step, so a fragmented heap's slack stays small. MALLOC_MMAP_THRESHOLD_ in
the environment sets it instead; `mmpg.plan.validate` measures at 64 KiB (VALIDATION_MMAP_THRESHOLD), where the
figure follows the live tensors closely but a small model's step is slower. run.json's record (`start`) says which
measure and threshold the figure was taken with: where /proc/self/clear_refs cannot be written, ru_maxrss stands for
VmHWM and imports are subtracted whole (a lower bound); without /proc the figure is the whole process's ru_maxrss.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import threading

MMAP_THRESHOLD = 1 << 20  # a CPU run's default (module docstring)
VALIDATION_MMAP_THRESHOLD = 64 << 10  # what the plan's CPU terms were measured at
WEIGHT_FILES = ".safetensors"  # checkpoint files transformers maps into memory rather than reading (the weights)
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


def _weight_pages() -> int:
    """Resident bytes of the mapped checkpoint files (*.safetensors; /proc/self/maps is read first, which is cheap,
    and /proc/self/smaps, ~10 ms, only while such a file is mapped)."""
    with open("/proc/self/maps") as f:
        if WEIGHT_FILES not in f.read():
            return 0
    total, counting = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef":  # a mapping's first line: its addresses ... and its path
                counting = line.rstrip().endswith(WEIGHT_FILES)
            elif counting and line.startswith(("Rss:", "Anonymous:")):
                # a page the run wrote (a trained weight) is copied into anonymous memory, where RssAnon counts it
                total += int(line.split()[1]) * 1024 * (1 if line[0] == "R" else -1)
    return total


def _anon() -> int:
    """Resident bytes not backed by a file or shared memory, from /proc/self/statm (resident - shared pages)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def reset_high_water() -> bool:
    """Restart the process's resident high-water mark (VmHWM) from now; False where the kernel does not allow it."""
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
    code = now["RssFile"] - _weight_pages()
    _base["best"] = max(_base["best"], high - code - _base["held"] - _base["imports"])
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
                        reset_high_water()  # the next peak is measured from here, the import's memory left out
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
    asked = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    # set here even when asked for in the environment: glibc reads that variable only when a process starts, and a
    # run may be forked from one that started without it
    threshold = str(int(asked) if asked.isdigit() else MMAP_THRESHOLD)
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)):
        threshold = asked or None
    gc.collect()
    if libc is not None:
        libc.malloc_trim(0)  # free pages the allocator kept from the imports: not the run's
    try:
        now = _status()
    except (OSError, ValueError):
        _base = None
        return {"measure": WHOLE_PROCESS}
    resettable = reset_high_water()
    held = now["RssAnon"] + now.get("RssShmem", 0) + _weight_pages()  # a checkpoint mapped before: not this run's
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
