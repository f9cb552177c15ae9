"""Measure one (config, variant) in this process: `python -m mmpg.bench.measure CASE.json RESULT.json`.

The runner starts one fresh process per (config, variant, round), so every measurement begins from a clean
allocator. In the process:

    setup (model, inputs)  ->  reset the memory high-water  ->  prepare (the attention level's q, k, v)
                           ->  cold step (memory; also the first warm-up)
                           ->  warmup - 1 more steps  ->  `repeats` timed steps

Peak memory = high-water during prepare + cold step − memory in use right before them (`mmpg.bench.memory`). The
cold step is the one measured because later steps reuse pages the allocator kept from earlier ones; for the same
reason a CPU step whose RSS did not grow has no measured peak (None, shown as n/a), not a peak of 0.
`measure(..., memory=False)` (the runner's in-process mode, where earlier variants left such pages behind and a
repeat reads 0) does not measure memory at all.

A step with `phased = True` (the step level, `mmpg.bench.step.StepRunner`) times its own phases and measures their
memory itself when called with memory=True (a `measured` around it would be reset by the phases' own resets); the
result then also holds `phase_times` (one dict of phase seconds per timed step) and `phase_peak_bytes`.

A case with sp > 1 (`mmpg.bench.sp`) runs as sp ranks under torchrun: every rank measures its own process and
writes its own RESULT.json.rank<r> (`rank_path`), which `mmpg.bench.sp.merge` combines.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import traceback

import torch

from mmpg.bench.levels import module_for
from mmpg.bench.memory import measured, sync
from mmpg.bench.tables import atomic_write

NOT_MEASURED = "not measured (in-process)"


def _setup(case: dict, device: torch.device):
    """The case's level module (`mmpg.bench.levels.LEVELS`) builds its model and inputs: (prepare, step, info)."""
    return importlib.import_module(module_for(case)).setup(case, device)


def _timed(step, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def measure(case: dict, warmup: int = 1, repeats: int = 3, memory: bool = True) -> dict:
    """Run one case here. Returns {"times": [...], "cold_s", "peak_bytes", "mem_method", "info", "error"};
    peak_bytes is None when memory was not measured (`memory=False`) or could not be (see the module docstring)."""
    device = torch.device(case.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = {"times": [], "cold_s": None, "peak_bytes": None, "mem_method": None if memory else NOT_MEASURED, "info": {},
           "error": None}
    try:
        prepare, step, out["info"] = _setup(case, device)
        if getattr(step, "phased", False):
            _measure_phased(step, out, warmup, repeats, memory)
            return out
        with measured(device) if memory else contextlib.nullcontext() as mem:
            if prepare is not None:
                prepare()
            out["cold_s"] = _timed(step, device)
        if memory:
            out["peak_bytes"], out["mem_method"] = mem.peak, mem.method
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
    for _ in range(max(warmup - 1, 0)):
        step()
    runs = [step() for _ in range(repeats)]
    out["times"] = [r["seconds"]["total"] for r in runs]
    out["phase_times"] = [r["seconds"] for r in runs]
    out["info"].update(runs[-1]["info"] if runs else cold["info"])


def rank_path(result: str, rank: int) -> str:
    """Where rank `rank` of a sequence-parallel case (`mmpg.bench.sp`) writes its result: RESULT.json.rank<r>."""
    return f"{result}.rank{rank}"


def main(argv: list[str]) -> int:
    """One process, or one rank of the case's sp under torchrun (RANK/WORLD_SIZE set): each rank measures its own
    memory and writes its own file (`rank_path`); a rank that failed exits 1, so torchrun stops the others instead
    of leaving them waiting in a collective."""
    if len(argv) != 2:
        print("usage: python -m mmpg.bench.measure CASE.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    out = measure(job["case"], job["warmup"], job["repeats"])
    atomic_write(argv[1] if world == 1 else rank_path(argv[1], rank), json.dumps(out))
    if world > 1 and out["error"]:
        print(f"rank {rank}: {out['error']}\n{out.get('traceback', '')}", file=sys.stderr, flush=True)
        return 1
    if world > 1:
        from mmpg import dist

        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
