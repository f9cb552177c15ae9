"""`mmpg doctor`: check this machine before a run. What it runs, in order, one report row each:

    environment  Python, torch and its CUDA, the driver, the GPUs, transformers, DeepSpeed, peft, flash-attn, vLLM
    grouped      each grouped backend against the repeated forward (logprobs and every gradient) on tiny Qwen2.5-VL,
                 Qwen3-VL and Qwen2: CPU sdpa and lse_reference (float32); CUDA also sdpa, flash and flex in bf16
    cascade      each cascade decoding kernel against the math kernel (CPU sdpa; CUDA sdpa and flash, bf16)
    decode       greedy decoding (what `mmpg eval` runs): cascade with each kernel vs the copy path, same tokens;
                 and which kernel rollout.decode=auto takes here (its own check on) and why
    train        three bf16 GRPO steps of `mmpg train` with the grouped forward's self-check
    sync         the vLLM engine's NCCL weight sync (one server: two GPUs; a pool: three), with a vLLM environment
    speed        grouped vs repeated forward + backward at one P and G; cascade vs copy decoding

On a CPU machine the CUDA rows are NOT RUN with the reason. UNTESTED on a GPU: the CUDA rows have not run on one;
a report from one is welcome. Writes doctor.md and doctor.json into --out and exits 0 when no row FAILED, 1 naming
the rows that did, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from mmpg.doctor import environment, results
from mmpg.doctor.results import Row, not_run

if TYPE_CHECKING:
    import torch

# torch and the checks (the grouped forward, transformers) are imported where the doctor runs: `mmpg`'s parser builds
# this command's arguments on every command (`add_arguments`), which must not cost a torch import

NO_CUDA = "needs a CUDA device: "


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="folder for doctor.md and doctor.json (default: "
                   "runs/doctor/<time>)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when usable, else the CPU (the CUDA rows then say NOT RUN and why)")
    p.add_argument("--quick", action="store_true", help="leave out the training run and the speed table "
                   "(about 15 s on a CPU instead of about a minute)")
    p.add_argument("--only", default="", metavar="PREFIXES", help="run only the rows whose id starts with one of "
                   "these comma-separated prefixes, e.g. grouped,cascade/flash (the environment is always read)")
    p.add_argument("--json", action="store_true", help="print doctor.json instead of the table")


def _wanted(only: str):
    prefixes = [w.strip() for w in only.split(",") if w.strip()]
    return lambda row_id: not prefixes or any(row_id.startswith(w) for w in prefixes)


FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2")


def grouped_plans() -> dict:
    """(backend, dtype) of each grouped row by device. CPU: float32 (the equivalence tests' bounds); CUDA: also
    bf16, what runs training."""
    import torch

    f32, bf16 = torch.float32, torch.bfloat16
    return {"cpu": [("sdpa", f32), ("lse_reference", f32)],
            "cuda": [("sdpa", f32), ("sdpa", bf16), ("lse_reference", f32), ("flash", bf16), ("flex", bf16)]}


def _grouped(device: torch.device, cuda_why: str) -> list:
    """(row id, function, args...) for each grouped backend check; those this machine cannot run as NOT RUN rows."""
    from mmpg.doctor import checks
    from mmpg.grouping.backends.probe import flash_status

    plans, table = [("grouped/auto", checks.grouped_auto_row, device)], grouped_plans()
    for family in FAMILIES:
        for backend, dtype in table["cuda"]:
            name = str(dtype).split(".")[-1]
            row_id, what = f"grouped/{backend}/{family}/{name}", f"grouped forward, backend {backend}, {family} ({name})"
            if (backend, dtype) in table[device.type]:
                plans.append((row_id, checks.grouped_row, family, backend, device, dtype))
            elif device.type != "cuda":
                plans.append(not_run("grouped", row_id, what, NO_CUDA + cuda_why))
            elif backend == "flash" and not flash_status(device)[0]:
                plans.append(not_run("grouped", row_id, what, "flash-attn: " + flash_status(device)[1]))
            else:
                plans.append((row_id, checks.grouped_row, family, backend, device, dtype))
    return plans


def _cascade_and_decode(device: torch.device, cuda_why: str) -> list:
    import torch

    from mmpg.doctor import checks
    from mmpg.grouping.backends.probe import flash_status

    plans = [("cascade/sdpa/float32", checks.cascade_row, "sdpa", device, torch.float32)]
    for kernel in ("sdpa", "flash"):
        row_id = f"cascade/{kernel}/bfloat16"
        if device.type != "cuda":
            plans.append(not_run("cascade", row_id, f"cascade kernel {kernel} vs math (bfloat16, cuda)",
                                 NO_CUDA + cuda_why))
        elif kernel == "flash" and not flash_status(device)[0]:
            plans.append(not_run("cascade", row_id, "cascade kernel flash vs math (bfloat16, cuda)",
                                 "flash-attn: " + flash_status(device)[1]))
        else:
            plans.append((row_id, checks.cascade_row, kernel, device, torch.bfloat16))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for family in FAMILIES:
        for kernel in ("sdpa", "math", "flash"):
            row_id = f"decode/{kernel}/{family}"
            if kernel != "flash" or (device.type == "cuda" and flash_status(device)[0]):
                plans.append((row_id, checks.decode_row, kernel, family, device, dtype))
            else:
                why = NO_CUDA + cuda_why if device.type != "cuda" else "flash-attn: " + flash_status(device)[1]
                plans.append(not_run("decode", row_id, f"greedy decoding, cascade (flash) vs copy, {family}", why))
        plans.append((f"decode/auto/{family}", checks.auto_row, family, device, dtype))
    return plans


SYNC_ROWS = {  # row: (what, GPUs it needs, why that many, the tests of tests/test_vllm_gpu.py it runs)
    "sync/nccl": ("vLLM engine: NCCL weight sync to one server", 2, "one for training, one for the server",
                  "not pool"),
    "sync/nccl-pool": ("vLLM engine: NCCL weight sync to a pool of two servers, one group (UNTESTED so far)", 3,
                       "one for training, one per server", "pool"),
}


def sync_row(row_id: str, device: torch.device, cuda_why: str) -> Row:
    """The NCCL weight sync of the vLLM engine: its GPU tests (tests/test_vllm_gpu.py) where they can run."""
    import torch

    text, gpus, why_gpus, select = SYNC_ROWS[row_id]
    what = f"{text} (tests/test_vllm_gpu.py -k '{select}')"
    if device.type != "cuda":
        return not_run("sync", row_id, what, NO_CUDA + cuda_why)
    if torch.cuda.device_count() < gpus:
        return not_run("sync", row_id, what, f"needs {gpus} GPUs ({why_gpus}); {torch.cuda.device_count()} here")
    py, why = environment.vllm_env()
    root = Path(__file__).resolve().parents[2]
    test = root / "tests" / "test_vllm_gpu.py"
    if py is None:
        return not_run("sync", row_id, what, why)
    if not test.exists():
        return not_run("sync", row_id, what, f"{test} is not here (an installed mmpg without its tests)")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu and vllm",
                           "-k", select, str(test)], cwd=root, capture_output=True, text=True, timeout=1200)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return Row("sync", row_id, what, "PASS" if proc.returncode == 0 else "FAIL", last,
               "" if proc.returncode == 0 else f"pytest exited {proc.returncode}", time.perf_counter() - t0)


def plan_rows(device: torch.device, cuda_why: str, quick: bool, work: Path) -> list:
    from mmpg.doctor import speed, train_check

    plans = [*_grouped(device, cuda_why), *_cascade_and_decode(device, cuda_why)]
    if quick:
        plans.append(not_run("train", "train/bf16", "mmpg train: 3 GRPO steps in bf16 with the self-check",
                             "left out by --quick"))
    else:
        plans.append(("train/bf16", train_check.train_row, work, device.type))
    plans += [(row_id, sync_row, row_id, device, cuda_why) for row_id in SYNC_ROWS]  # filtered, guarded as the others
    if quick:
        plans += [not_run("speed", f"speed/{k}", f"speed: {k}", "left out by --quick") for k in ("forward", "decode")]
    else:
        plans += [("speed/forward", speed.forward_row, device), ("speed/decode", speed.decode_row, device)]
    return plans


def _device(choice: str, cuda: bool, cuda_why: str) -> torch.device:
    import torch

    if choice == "cuda" and not cuda:
        from mmpg.errors import UserError

        raise UserError(f"--device cuda, but {cuda_why}; run with --device auto or cpu to check the rest")
    return torch.device("cuda", 0) if choice == "cuda" or (choice == "auto" and cuda) else torch.device("cpu")


def run(args) -> int:
    from mmpg.doctor import checks

    os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stamp = datetime.now(timezone.utc)
    out = Path(args.out or f"runs/doctor/{stamp:%Y%m%d-%H%M%S}")
    env_rows, lines, record, cuda = environment.environment()
    cuda_why = next(r for r in env_rows if r.id == "env/cuda").detail or "CUDA not chosen (--device cpu)"
    device = _device(args.device, cuda, cuda_why)
    wanted = _wanted(args.only)
    rows = list(env_rows)
    with tempfile.TemporaryDirectory(prefix="mmpg-doctor-") as work:
        for plan in plan_rows(device, cuda_why, args.quick, Path(work)):
            if isinstance(plan, Row):
                row = plan
            elif not wanted(plan[0]):
                continue
            else:
                row_id, fn, *fn_args = plan
                row = checks.guarded(fn, row_id.split("/")[0], row_id, row_id, *fn_args)
            if not wanted(row.id):
                continue
            rows.append(row)
            if not args.json:
                print(f"[doctor] {row.status:7} {row.id:32} {row.figure or row.detail}"[:200], flush=True)
    record["date"] = stamp.isoformat(timespec="seconds")
    record["device"] = str(device)
    title = f"mmpg doctor, {stamp:%Y-%m-%d %H:%M} UTC, {device.type}"
    code = results.write(out, rows, lines, record, title)
    print((out / "doctor.json").read_text() if args.json else results.markdown(rows, lines, title))
    print(results.summary(rows) + f"; report: {out / 'doctor.md'}", file=sys.stderr if args.json else sys.stdout)
    return code
