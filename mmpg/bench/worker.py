"""Measure one (config, variant) in this process: `python -m mmpg.bench.worker CASE.json RESULT.json`.

The runner starts one fresh process per (config, variant, round), so every measurement begins from a clean
allocator. In the process:

    setup (model, inputs)  ->  reset the memory high-water  ->  prepare (the attention level's q, k, v)
                           ->  cold step (memory; also the first warm-up)
                           ->  warmup - 1 more steps  ->  `repeats` timed steps

Peak memory = high-water during prepare + cold step − memory in use right before them:
    CPU  resident set size: VmHWM after `echo 5 > /proc/self/clear_refs` (resets the high-water), minus the RSS
         before; where clear_refs is not writable, `ru_maxrss` (the process high-water, which cannot be reset)
         minus the RSS before, and only when the step raised it: otherwise its peak is hidden under an earlier one.
    GPU  `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, minus `memory_allocated()` before.
The cold step is the one measured because later steps reuse pages the allocator kept from earlier ones. For the
same reason a CPU step whose RSS did not grow has no measured peak (None, shown as n/a), not a peak of 0: its
memory came from pages the process already held. `measure(..., memory=False)` (the runner's in-process mode, where
earlier variants left such pages behind and a repeat reads 0) does not measure memory at all.

A step with `phased = True` (the step level, `mmpg.bench.step.StepRunner`) times its own phases and measures their
memory itself when called with memory=True (a `_Memory` around it would be reset by the phases' own resets); the
result then also holds `phase_times` (one dict of phase seconds per timed step) and `phase_peak_bytes`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import sys
import time
import traceback

import torch

LEVELS = ("attention", "model", "rollout", "step")
NOT_MEASURED = "not measured (in-process)"


def _setup(case: dict, device: torch.device):
    level = case["level"]
    if level == "attention":
        from mmpg.bench.attention import setup
    elif level == "model":
        from mmpg.bench.model import setup
    elif level == "rollout":
        from mmpg.bench.rollout import setup
    elif level == "step":
        from mmpg.bench.step import setup
    else:
        raise ValueError(f"unknown bench level {level!r}; choose one of {', '.join(LEVELS)}")
    return setup(case, device)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class _Memory:
    """Context manager measuring the peak extra memory of its body (see the module docstring); `peak` is None when
    the body's peak could not be seen."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self.method = device, None, ""

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base, self.method = torch.cuda.memory_allocated(self.device), "cuda.max_memory_allocated"
        else:
            self.base = _rss()
            self.method = "VmHWM-after-clear_refs" if _reset_hwm() else "ru_maxrss"
            self.hwm_before = _maxrss()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = max(torch.cuda.max_memory_allocated(self.device) - self.base, 0)  # exact: 0 is 0
        elif self.method == "ru_maxrss":
            high = _maxrss()
            self.peak = high - self.base if high > self.hwm_before else None
        else:
            grown = _hwm() - self.base
            self.peak = grown if grown > 0 else None
        return False


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _timed(step, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(case: dict, warmup: int = 1, repeats: int = 3, memory: bool = True) -> dict:
    """Run one case here. Returns {"times": [...], "cold_s", "peak_bytes", "mem_method", "info", "error"};
    peak_bytes is None when memory was not measured (`memory=False`) or could not be (see the module docstring)."""
    device = torch.device(case.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = {"times": [], "cold_s": None, "peak_bytes": None, "mem_method": None, "info": {}, "error": None}
    try:
        prepare, step, out["info"] = _setup(case, device)
        if getattr(step, "phased", False):
            _measure_phased(step, out, warmup, repeats, memory)
            return out
        with _Memory(device) if memory else contextlib.nullcontext() as mem:
            if prepare is not None:
                prepare()
            out["cold_s"] = _timed(step, device)
        if memory:
            out["peak_bytes"], out["mem_method"] = mem.peak, mem.method
        else:
            out["mem_method"] = NOT_MEASURED
        for _ in range(max(warmup - 1, 0)):
            _timed(step, device)
        out["times"] = [_timed(step, device) for _ in range(repeats)]
    except torch.OutOfMemoryError:
        out["error"] = "OOM"
    except NotImplementedError as err:
        out["error"] = f"n/a: {err}"
    except Exception as err:  # noqa: BLE001 - the runner reports it in the table and carries on
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()
    return out


def _measure_phased(step, out: dict, warmup: int, repeats: int, memory: bool) -> None:
    """A step that times its phases (and, when asked, measures their memory) itself; fills `out` in place."""
    cold = step(memory=memory)
    out["cold_s"] = cold["seconds"]["total"]
    if memory:
        out["peak_bytes"], out["phase_peak_bytes"] = cold["peak_bytes"]["total"], cold["peak_bytes"]
        out["mem_method"] = cold["mem_method"]
    else:
        out["mem_method"] = NOT_MEASURED
    for _ in range(max(warmup - 1, 0)):
        step()
    runs = [step() for _ in range(repeats)]
    out["times"] = [r["seconds"]["total"] for r in runs]
    out["phase_times"] = [r["seconds"] for r in runs]
    out["info"].update(runs[-1]["info"] if runs else cold["info"])


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m mmpg.bench.worker CASE.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    _write_json(argv[1], measure(job["case"], job["warmup"], job["repeats"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
