"""The decisions of scripts/gpu_check.sh, in Python so they are tested on a CPU (tests/test_gpu_check_report.py).

    python -m mmpg.grouping.gpu_check env                     torch, CUDA, driver, GPU, flash-attn; exit 3 without a GPU
    python -m mmpg.grouping.gpu_check plan --budget 570       time limits from the FLOPs model (shell assignments)
    python -m mmpg.grouping.gpu_check summary --junit X.xml --bench-status N [--bench-json J] [--gpu yes|no]

`env` says what is wrong when torch sees no GPU — above all a driver older than the CUDA torch was built for (torch
2.14.1 from PyPI is built for CUDA 13.0 and needs a driver of the 580 series or newer) — instead of dying in
`get_device_name(0)`. `plan` sizes the two long stages from `mmpg.bench.flops` instead of guessing: the bench's
slowest worker is the repeated baseline of the model level (Qwen2.5-VL-3B-sized LM, P 16K, S 512, G 16: 6.5e15
FLOPs per step, 4/3 of that with gradient checkpointing), at a conservative THROUGHPUT of bf16 FLOP/s, plus a fixed
start-up per process.
`summary` prints one row per GPU path — flash kernel, flex, sdpa on CUDA, the bench — from the pytest JUnit file and
the bench's exit status, and returns non-zero when a GPU is present and any path did not run and pass: a skipped
flash test (flash-attn failed to install) is a failure of the check, not a success.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import xml.etree.ElementTree as ET

THROUGHPUT = 250e12  # bf16 FLOP/s a random-weight HF model reaches on an H100/H200 (about 1/3 of the matmul peak)
PROCESS_START_S = 45  # one bench worker: interpreter, CUDA context, random init of a 3B model
TESTS_S = 180  # gpu tests: tiny models; dominated by FlexAttention compiles (block mask + kernel, twice)
ATTENTION_WORKER_S = 30  # one attention-level bench worker (start-up; its step is < 1 s by the FLOPs model)
FLEX_COMPILE_S = 60  # the flex worker's two compiles
SUMMARY_S = 15

# path -> substrings of the gpu test ids that exercise it
PATHS = {
    "flash kernel (flash-attn varlen)": ("flash",),
    "flex (FlexAttention, compiled)": ("flex",),
    "sdpa on CUDA": ("sdpa", "cuda_model"),
}


@dataclasses.dataclass
class Outcome:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def status(self) -> str:
        if self.failed:
            return "FAILED"
        if self.passed and not self.skipped:
            return "passed"
        if self.passed:
            return "PARTLY RUN"
        return "NOT RUN"


def _step_s(grouped: bool) -> float:
    """Seconds of one training step of the gpu preset's model level by the FLOPs model (checkpointing: +1 forward)."""
    from mmpg.bench import flops

    lm = dataclasses.replace(flops.QWEN2_5_VL_3B, vision=None)
    return flops.step_flops(lm, 16384, 512, 16, grouped=grouped) * 4 / 3 / THROUGHPUT


def plan(budget_s: float, warmup: int = 1, repeats: int = 1) -> dict[str, int | str]:
    """Limits for what remains of the 10 minutes after set-up: the gpu tests, one bench worker, the whole bench, and
    the bench variants that fit (the upstream package's variant goes first when the estimate does not fit)."""
    rep_s, grp_s = _step_s(grouped=False), _step_s(grouped=True)
    worker = lambda step_s: PROCESS_START_S + 1.5 * (warmup + repeats) * step_s  # noqa: E731
    attention = 4 * ATTENTION_WORKER_S + FLEX_COMPILE_S  # naive, upstream, flash, flex
    full = attention + worker(rep_s) + 2 * worker(grp_s)  # model level: repeated, upstream, mmpg
    bench_s = int(budget_s - TESTS_S - SUMMARY_S)
    fits = full <= bench_s
    estimate = full if fits else full - ATTENTION_WORKER_S - worker(grp_s)
    return {"TESTS_S": TESTS_S, "WORKER_S": math.ceil(worker(rep_s)), "BENCH_S": bench_s,
            "BENCH_EST_S": math.ceil(estimate), "STEP_S": math.ceil(rep_s),
            "BENCH_VARIANTS": "" if fits else "naive,repeated,mmpg"}


def read_junit(path: str) -> dict[str, Outcome]:
    """Outcome per GPU path from a pytest --junitxml file (a missing or unreadable file: every path NOT RUN)."""
    out = {name: Outcome() for name in PATHS}
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except (OSError, ET.ParseError) as err:
        for o in out.values():
            o.reasons.append(f"no test results ({err})")
        return out
    for case in cases:
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        for name, keys in PATHS.items():
            if not any(k in case.get("name", "") for k in keys):
                continue
            o = out[name]
            if failed:
                o.failed += 1
                o.reasons.append(f"failed: {test_id}")
            elif skipped is not None:
                o.skipped += 1
                o.reasons.append(f"skipped: {skipped.get('message', '')[:120]}")
            else:
                o.passed += 1
    return out


def summary(junit: str, bench_status: int | None, gpu_present: bool, bench_json: str | None = None
            ) -> tuple[list[tuple[str, str, str]], int]:
    """(rows of (path, status, detail), exit code). Exit 0 only with a GPU and every path passed."""
    if not gpu_present:
        return [("GPU", "NOT FOUND", "torch sees no CUDA device: nothing GPU-side was checked")], 3
    rows = []
    for name, o in read_junit(junit).items():
        detail = f"{o.passed} passed, {o.failed} failed, {o.skipped} skipped"
        if o.reasons and o.status != "passed":
            detail += "; " + sorted(set(o.reasons))[0]
        rows.append((name, o.status, detail))
    if bench_status is None:
        rows.append(("bench --preset gpu", "NOT RUN", "the script stopped before it"))
    elif bench_status != 0:
        why = "timed out" if bench_status in (124, 137) else f"exit status {bench_status}"
        rows.append(("bench --preset gpu", "FAILED", why))
    else:
        rows.append(("bench --preset gpu", "passed", bench_json or ""))
    code = 0 if all(status == "passed" for _, status, _ in rows) else 1
    return rows, code


def format_table(rows) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'GPU path'.ljust(width)}  {'status':10}  detail", "-" * (width + 40)]
    lines += [f"{name.ljust(width)}  {status:10}  {detail}" for name, status, detail in rows]
    return "\n".join(lines)


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def environment() -> tuple[list[str], int]:
    """(lines to print, exit code): 0 with a usable GPU, 3 without one (with the reason)."""
    import torch

    from mmpg.grouping.backends.probe import flash_status

    lines = [f"torch {torch.__version__}, built for CUDA {torch.version.cuda}"]
    if torch.version.cuda is None:
        return lines + ["this torch is a CPU build: install one built for CUDA (scripts/env.sh, MMPG_TORCH=...)"], 3
    driver = torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else 0
    need = int(torch.version.cuda.split(".")[0]) * 1000 + int(torch.version.cuda.split(".")[1]) * 10
    if not driver:
        return lines + ["no NVIDIA driver found (is this a GPU machine? `nvidia-smi` should list the GPU)"], 3
    lines.append(f"NVIDIA driver supports CUDA up to {_cuda_version(driver)}")
    if driver < need:
        return lines + [f"the driver is too old for this torch: it needs CUDA >= {torch.version.cuda} (driver 580 or "
                        f"newer for CUDA 13.0); update the driver, or install a torch built for CUDA "
                        f"{_cuda_version(driver)} or older, e.g. MMPG_TORCH='torch==2.14.1 torchvision==0.29.1 "
                        "--index-url <a cu12x index>' before scripts/env.sh"], 3
    if not torch.cuda.is_available():
        return lines + ["torch sees no CUDA device although the driver is there (CUDA_VISIBLE_DEVICES? a container "
                        "started without --gpus?)"], 3
    device = torch.device("cuda", 0)
    lines.append(f"device 0: {torch.cuda.get_device_name(device)}, compute capability "
                 f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}, {torch.cuda.device_count()} GPU(s)")
    usable, reason = flash_status(device)
    lines.append("flash-attn: usable" if usable else f"flash-attn: NOT usable: {reason}")
    return lines, 0


def _gpu_present(flag: str) -> bool:
    if flag != "auto":
        return flag == "yes"
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmpg.grouping.gpu_check")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="print torch / CUDA / driver / GPU / flash-attn; exit 3 without a usable GPU")
    p = sub.add_parser("plan", help="print shell assignments of the time limits")
    p.add_argument("--budget", type=float, required=True, help="seconds left for tests + bench + summary")
    s = sub.add_parser("summary", help="print the summary table; exit non-zero if a GPU path did not run and pass")
    s.add_argument("--junit", required=True)
    s.add_argument("--bench-status", type=int, default=None)
    s.add_argument("--bench-json", default=None)
    s.add_argument("--gpu", choices=("yes", "no", "auto"), default="auto")
    args = parser.parse_args(argv)
    if args.cmd == "env":
        lines, code = environment()
        print("\n".join(lines))
        return code
    if args.cmd == "plan":
        for key, value in plan(args.budget).items():
            print(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
        return 0
    rows, code = summary(args.junit, args.bench_status, _gpu_present(args.gpu), args.bench_json)
    print(format_table(rows))
    print("gpu_check: " + ("every GPU path ran and passed" if code == 0 else "NOT every GPU path ran and passed"))
    return code


if __name__ == "__main__":
    sys.exit(main())
