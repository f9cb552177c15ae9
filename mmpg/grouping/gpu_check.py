"""The decisions of scripts/gpu_check.sh, in Python so they are tested on a CPU (tests/test_gpu_check_report.py).

    python -m mmpg.grouping.gpu_check plan --mode device|rehearse      stage time limits (shell assignments)
    python -m mmpg.grouping.gpu_check plan-bench --left S --mode M      bench runs that fit S seconds, one a line
    python -m mmpg.grouping.gpu_check env --json F [--site DIR]         torch, CUDA, driver, GPU, backends; exit 3
                                                                        without a usable GPU
    python -m mmpg.grouping.gpu_check report --work W --out O --mode M  the summary table (markdown and JSON)
    python -m mmpg.grouping.gpu_check train-table --runs DIR            rows of scripts/gpu_train_check.sh's runs
    python -m mmpg.grouping.gpu_check bundle-specs | bundle-flags | bundle-list | bundle-check | deps | audit
                                                                        the wheels that travel (gpu_bundle.py)

The run (one H200, 8 minutes of wall clock, `TOTAL_S`): install the bundle, read the environment, the `gpu` tests,
a short `mmpg train`, the bench with what is left, the summary. Each stage runs under its own limit; the bench is
sized by the FLOPs model (`mmpg.bench.flops`) at a conservative THROUGHPUT of bf16 FLOP/s plus a fixed start-up per
worker process, to the seconds left when it starts. The constants below are estimates made without a GPU: the first
GPU run's log gives the real figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

TOTAL_S = 480  # the whole run, wall clock (the device session's 15 minutes also pay the machine's start and copies)
THROUGHPUT = 250e12  # bf16 FLOP/s a random-weight HF model reaches on an H100/H200 (about 1/3 of the matmul peak)
PROCESS_START_S = 45  # one bench worker: interpreter, CUDA context, random init of a 3B model
ATTENTION_WORKER_S = 30  # one attention-level bench worker (start-up; its step is < 1 s by the FLOPs model)
FLEX_COMPILE_S = 60  # a flex worker's compiles (block mask + kernel)
STEP_LEVEL_S = 2 * (PROCESS_START_S + 3 * 20)  # bench --levels step, naive and mmpg (2B model, 256 decode steps)
STAGES = {  # mode -> stage -> seconds; the bench gets what is left of the total when it starts
    "device": {"install": 20, "env": 30, "collect": 20, "tests_grouped": 120, "tests_cascade": 45, "train": 75,
               "summary": 15},
    "rehearse": {"install": 120, "env": 60, "collect": 60, "tests_grouped": 120, "tests_cascade": 120,
                 "tests_cpu": 240, "train": 240, "bench": 150, "summary": 30},
}
BENCH_P = (16384, 8192, 4096, 2048)  # the gpu preset's prefix length, then halved until the model level fits


def plan(mode: str, total_s: int = TOTAL_S) -> dict[str, int]:
    """Stage limits: `<STAGE>_S` for each stage and TOTAL_S; on the device BENCH_S is what the fixed stages leave."""
    limits = dict(STAGES[mode])
    if mode == "device":
        limits["bench"] = total_s - sum(limits.values())
        if limits["bench"] < 0:
            raise ValueError(f"a total of {total_s} s leaves nothing for the bench; the fixed stages need "
                             f"{sum(STAGES[mode].values())} s")
    else:
        total_s = sum(limits.values())
    return {f"{k.upper()}_S": v for k, v in limits.items()} | {"TOTAL_S": total_s}


def _step_s(P: int, grouped: bool, S: int = 512, G: int = 16) -> float:
    """Seconds of one training step of the gpu preset's model level by the FLOPs model (checkpointing: +1 forward)."""
    from mmpg.bench import flops

    lm = dataclasses.replace(flops.QWEN2_5_VL_3B, vision=None)
    return flops.step_flops(lm, P, S, G, grouped=grouped) * 4 / 3 / THROUGHPUT


def _worker_s(step_s: float, warmup: int = 1, repeats: int = 1) -> float:
    return PROCESS_START_S + 1.5 * (warmup + repeats) * step_s


@dataclasses.dataclass
class BenchRun:
    name: str
    estimate_s: int
    worker_s: int  # --timeout per worker process
    args: list[str]

    def line(self) -> str:
        return " ".join([self.name, str(self.estimate_s), str(self.worker_s), *self.args])


ONE_ROUND = ["--rounds", "1", "--repeats", "1", "--warmup", "1"]


def plan_bench(left_s: float, mode: str = "device") -> list[BenchRun]:
    """The bench runs that fit `left_s`, in order: the model level (3B LM, S 512, G 16; repeated vs mmpg) at the
    largest prefix of BENCH_P that fits, then the attention level at P 16K (naive vs mmpg), then the step level and
    the GPU rollout when there is room. The upstream `prefix_grouper` variant is left out: it does not fit 8
    minutes beside the rest, and its package is not in the bundle."""
    if mode == "rehearse":
        return [BenchRun("bench-tiny", 150, 120, ["--preset", "tiny", "--levels", "attention,model", "--variants",
                                                  "naive,repeated,mmpg", *ONE_ROUND])]
    runs = []
    for P in BENCH_P:
        rep = _worker_s(_step_s(P, grouped=False))
        est = rep + _worker_s(_step_s(P, grouped=True))
        if est <= left_s:
            runs.append(BenchRun(f"bench-model-P{P}", math.ceil(est), math.ceil(1.5 * rep),
                                 ["--preset", "gpu", "--levels", "model", "--variants", "repeated,mmpg",
                                  "--P", str(P), *ONE_ROUND]))
            left_s -= est
            break
    attention = 2 * ATTENTION_WORKER_S + FLEX_COMPILE_S
    if attention <= left_s:
        runs.append(BenchRun("bench-attention", attention, 2 * (ATTENTION_WORKER_S + FLEX_COMPILE_S),
                             ["--preset", "gpu", "--levels", "attention", "--variants", "naive,mmpg", *ONE_ROUND]))
        left_s -= attention
    if STEP_LEVEL_S <= left_s:
        runs.append(BenchRun("bench-step", STEP_LEVEL_S, STEP_LEVEL_S,
                             ["--preset", "gpu", "--levels", "step", *ONE_ROUND]))
        left_s -= STEP_LEVEL_S
    rollout = 3 * (PROCESS_START_S + 60)  # generate, copy, cascade (+ cascade_sdpa): 2 x 256 decode steps each
    if rollout <= left_s:
        runs.append(BenchRun("bench-rollout", rollout, PROCESS_START_S + 120,
                             ["--preset", "rollout-gpu", "--variants", "hf_generate,mmpg:copy,mmpg:cascade_sdpa",
                              *ONE_ROUND]))
    return runs


# ---- environment ----------------------------------------------------------------------------------------------------

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


def backends(cuda: bool) -> dict[str, str]:
    """backend -> "usable" or "NOT usable: why", for the grouped forward and cascade decoding on this machine."""
    import torch

    from mmpg.grouping.backends.probe import flash_status

    out = {}
    if not cuda:
        why = "no CUDA device here"
        out["grouped sdpa"] = "usable on the CPU (torch's CPU flash kernel); the masked CUDA path needs a GPU"
        out["grouped flex"] = "forward only on the CPU (no CPU backward); " + why
        out["grouped flash"] = "NOT usable: " + flash_status(torch.device("cpu"))[1]
        out["cascade sdpa"] = "usable on the CPU (CPU flash kernel); the memory-efficient CUDA kernel: " + why
        out["cascade flash"] = "NOT usable: " + why
    else:
        out["grouped sdpa"] = "usable (masked path; torch's fused kernels)"
        try:
            import triton  # noqa: F401
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

            out["grouped flex"] = f"importable (triton {triton.__version__}); compiled and run in the tests stage"
        except ImportError as err:
            out["grouped flex"] = f"NOT usable: {err}"
        usable, reason = flash_status(torch.device("cuda", 0))
        out["grouped flash"] = "usable" if usable else "NOT usable: " + reason
        out["cascade sdpa"] = ("enabled (torch.backends.cuda.mem_efficient_sdp_enabled); run in the tests stage"
                               if torch.backends.cuda.mem_efficient_sdp_enabled()
                               else "NOT usable: memory-efficient SDPA disabled")
        out["cascade flash"] = out["grouped flash"]
    out["vLLM rollout engine"] = ("NOT usable: vLLM's CUDA wheel is 321 MiB (0.33.0) and pins a torch of its own; it "
                                  "cannot travel in 64 MiB and the machine reaches no registry")
    return out


def env_record(site: str | None) -> tuple[list[str], dict, int]:
    """(lines, record for the report, exit code of `environment`), with the backends, the transformers version and,
    on the device (`site`: the bundle's --target folder), the bundle's requirements and the image's versions."""
    import platform

    import torch
    import transformers

    from mmpg.grouping import gpu_bundle

    lines, code = environment()
    cuda = code == 0
    record = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "transformers": transformers.__version__, "gpu": None, "lines": list(lines)}
    if cuda:
        record["gpu"] = torch.cuda.get_device_name(0)
        record["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        record["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
        lines.append(f"nvidia-smi: {record['nvidia_smi']}")
    lines.append(f"python {record['python']}, transformers {record['transformers']}")
    record["backends"] = backends(cuda)
    lines += [f"  {name:20} {state}" for name, state in record["backends"].items()]
    if site:
        record["deps_problems"] = gpu_bundle.deps_problems(Path(site))
        lines.append("bundle requirements on this machine: " + ("all met" if not record["deps_problems"] else
                                                              "NOT met:"))
        lines += [f"  {p}" for p in record["deps_problems"]]
        readings = gpu_bundle.image_readings()
        record["image_readings"] = readings
        lines += ["image versions (on record or assumed) against what is installed:", *readings]
    return lines, record, code


# ---- command line ---------------------------------------------------------------------------------------------------

def _bundle_cmd(args) -> int:
    from mmpg.grouping import gpu_bundle as b

    if args.cmd == "bundle-specs":
        print("\n".join(b.pip_specs()))
        return 0
    if args.cmd == "bundle-flags":
        print("\n".join(b.download_flags()))
        return 0
    if args.cmd == "deps":
        problems = b.deps_problems(Path(args.target))
        print("\n".join(problems) or "every requirement of the bundle is met")
        return 1 if problems else 0
    root = Path(__file__).resolve().parents[2]
    if args.cmd == "audit":
        lines, problems = b.audit_problems(Path(args.log), root)
    elif args.cmd == "bundle-list":
        lines, problems = b.bundle_lines(Path(args.wheels))
        size, fits = b.size_lines(root, [Path(args.wheels)])
        lines += ["what travels to the device:", *size]
        problems += [] if fits else ["the working tree plus wheels/ pass the device tool's 64 MiB"]
    else:
        lines, problems = b.check_bundle(Path(args.wheels))
        size, fits = b.size_lines(root, [Path(args.wheels)])
        lines += ["what travels to the device:", *size]
        problems += [] if fits else ["the working tree plus wheels/ pass the device tool's 64 MiB"]
    print("\n".join(lines))
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"{args.cmd}: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmpg.grouping.gpu_check")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="print shell assignments of the stage time limits")
    p.add_argument("--mode", choices=tuple(STAGES), default="device")
    p.add_argument("--total", type=int, default=TOTAL_S, help="seconds for the whole device run")
    p = sub.add_parser("plan-bench", help="print the bench runs that fit: NAME ESTIMATE_S WORKER_S ARGS...")
    p.add_argument("--left", type=float, required=True)
    p.add_argument("--mode", choices=tuple(STAGES), default="device")
    p = sub.add_parser("env", help="torch / CUDA / driver / GPU / backends; exit 3 without a usable GPU")
    p.add_argument("--json", default=None)
    p.add_argument("--site", default=None, help="the bundle's install folder (device): check its requirements")
    p = sub.add_parser("report", help="the summary table; exit 0 only when every path ran and passed")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=tuple(STAGES), default="device")
    for name in ("bundle-specs", "bundle-flags"):
        sub.add_parser(name)
    for name in ("bundle-list", "bundle-check"):
        sub.add_parser(name).add_argument("--wheels", default="wheels")
    sub.add_parser("train-table", help="one row per run of scripts/gpu_train_check.sh").add_argument(
        "--runs", required=True)
    sub.add_parser("deps").add_argument("--target", required=True)
    sub.add_parser("audit").add_argument("--log", required=True)
    args = parser.parse_args(argv)
    if args.cmd.startswith("bundle") or args.cmd in ("deps", "audit"):
        return _bundle_cmd(args)
    if args.cmd == "plan":
        for key, value in plan(args.mode, args.total).items():
            print(f"{key}={value}")
        return 0
    if args.cmd == "plan-bench":
        for run in plan_bench(args.left, args.mode):
            print(run.line())
        return 0
    if args.cmd == "env":
        lines, record, code = env_record(args.site)
        print("\n".join(lines))
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1))
        return code
    from mmpg.grouping import gpu_report

    if args.cmd == "train-table":
        rows = gpu_report.train_rows(Path(args.runs))
        for r in rows:
            print(f"{r.path:48} {r.status:8} {r.figure}" + (f"  [{r.detail}]" if r.detail else ""))
        return 0 if all(r.status == "PASS" for r in rows) else 1
    return gpu_report.report(Path(args.work), Path(args.out), args.mode)


if __name__ == "__main__":
    sys.exit(main())
