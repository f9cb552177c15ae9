"""Validate `mmpg plan --device cpu` against measured CPU peaks: predicted vs measured, median and worst error.

    python -m mmpg.plan.validate --measure results/plan_cpu.jsonl     # one process per case (minutes each)
    python -m mmpg.plan.validate --measure results/plan_cpu.jsonl --time   # the naive / mmpg step-time pair
    python -m mmpg.plan.validate --report results/plan_cpu.jsonl [--json results/plan_cpu.json]
    python -m mmpg.plan.validate --case '<case json>'      # measure one case here: one JSON line {"peak_bytes", ...}

A case is the bench's step level (`mmpg.bench.step`): one prompt, G responses of exactly S tokens, one micro-batch,
float32, the KL term on (beta 0.04) against a frozen copy or, with LoRA, the policy with its adapters off, the
vision tower frozen, DeepSpeed at the case's ZeRO stage in one process. The grid is a fractional design over the
factors the memory model has terms for: two model sizes (the bench's tiny model, LM hidden 64 x 2 layers, and its
cpu-targets model, 256 x 4), ZeRO 0/2/3, LoRA off/r 8, G 4/16, P ~1k/8k (mostly video tokens), gradient
checkpointing off/on, grouped (mmpg) and naive (generate + repeated forward); S 64. Every level of every factor
appears; the naive layout is left out at P 8k with G 16 and for the small model at P 8k. Each case is measured in
its own process (`--case`) so that no case sees another's pages; `--measure` appends one JSON line per case as it
finishes (a killed run keeps what it measured; a rerun skips the cases already in the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mmpg.plan.memory import predict
from mmpg.plan.recipe import Recipe

MODELS = {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
          "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}}
S = 64
# (G, P, gradient checkpointing, variant): eight combinations, each model x ZeRO x LoRA cell takes two of them in turn
ROTATION = [(4, 1024, False, "naive"), (16, 8192, True, "mmpg"), (16, 1024, False, "mmpg"), (4, 8192, True, "naive"),
            (4, 1024, True, "mmpg"), (16, 8192, False, "mmpg"), (16, 1024, True, "naive"), (4, 8192, False, "mmpg")]


def grid() -> list[dict]:
    cases = []
    for i, (model, zero, lora) in enumerate(itertools.product(MODELS, (0, 2, 3), (0, 8))):
        for G, P, ckpt, variant in (ROTATION[(2 * i) % 8], ROTATION[(2 * i + 1) % 8]):
            if model == "small" and P == 8192 and variant == "naive":
                variant = "mmpg"
            cases.append(case(model, zero, lora, G, P, ckpt, variant))
    return cases


def case(model: str, zero: int, lora: int, G: int, P: int, ckpt: bool, variant: str) -> dict:
    name = f"{model}-z{zero}-lora{lora}-G{G}-P{P}-{'ckpt' if ckpt else 'nockpt'}-{variant}"
    return {"name": name, "model": model, "level": "step", "variant": variant, "P": P, "S": S, "G": G,
            "family": "qwen2_5_vl", "spec": dict(MODELS[model]), "dtype": "float32", "beta": 0.04,
            "freeze_vision": True, "self_check": "off", "zero": zero, "lora_r": lora,
            "ref": "adapters_off" if lora else "copy", "grad_ckpt": ckpt, "threads": 1}



def case_recipe(case: dict) -> Recipe:
    """The recipe a case runs. Of the CPU plan's own terms it carries those the measured step has: not a training
    run's `runtime` (the baseline is taken after a warm step), no decoded frames and no padded naive rows (every
    response is S tokens, so no dense mask)."""
    from mmpg.bench.batch import prompt_shape
    from mmpg.bench.model import model_config
    from mmpg.models.geometry import from_config_dict

    config, _ = model_config(case)
    geometry = from_config_dict(config.to_dict(), case.get("name", case["family"]))
    shape = prompt_shape(case["P"], config, case.get("video"))
    grouped = case["variant"] != "naive"
    return Recipe(geometry, P=shape["P"], S=case["S"], G=case["G"], video_tokens=shape.get("video_tokens", 0), b=4,
                  mixed=False, zero=case.get("zero", 0), lora_r=case.get("lora_r", 0),
                  freeze_vision=case.get("freeze_vision", True),
                  reference=("adapters_off" if case.get("ref") == "adapters_off" else "copy")
                  if case.get("beta", 0.04) > 0 else "none",
                  ckpt=bool(case.get("grad_ckpt")), grouped=grouped, decode="cascade" if grouped else "copy",
                  cold=True, device="cpu", self_check=case.get("self_check", "on") != "off")


def predict_case(case: dict) -> int:
    """Predicted CPU peak (bytes) of the case's build + one cold step, as `measure` measures it."""
    return predict(case_recipe(case))["peak_bytes"]

def holdout() -> list[dict]:
    """Cases at levels the grid does not use (G 8, P ~2k/4k, S 32/128, LoRA r 16), measured after the model was
    last changed: its out-of-sample check."""
    spec = [("tiny", 0, 16, 8, 2048, True, "naive", 32), ("tiny", 2, 0, 8, 4096, False, "mmpg", 128),
            ("tiny", 3, 16, 8, 4096, True, "mmpg", 32), ("small", 0, 0, 8, 2048, True, "mmpg", 128),
            ("small", 2, 16, 8, 4096, False, "mmpg", 32), ("small", 3, 0, 8, 2048, False, "naive", 32),
            ("small", 0, 16, 4, 4096, True, "naive", 32), ("tiny", 0, 0, 8, 2048, False, "naive", 128)]
    out = []
    for model, zero, lora, G, P, ckpt, variant, S in spec:
        c = case(model, zero, lora, G, P, ckpt, variant)
        out.append(dict(c, S=S, name=c["name"].replace(f"-G{G}-", f"-G{G}-S{S}-") + "-holdout"))
    return out


def time_cases() -> list[dict]:
    """The step-time pair: the bench's CPU step preset (small model, P ~2k, S 128, G 8, ZeRO 0), naive and mmpg."""
    out = []
    for variant in ("naive", "mmpg"):
        c = case("small", 0, 0, 8, 2048, False, variant)
        out.append(dict(c, S=128, name=c["name"].replace("-G8-", "-G8-S128-") + "-time"))
    return out


def measure_all(path: Path, only: str = "", cases: list | None = None) -> None:
    lines = path.read_text().splitlines() if path.exists() else []
    done = {json.loads(line)["name"] for line in lines if line.strip()}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024), OMP_NUM_THREADS="1")
    for c in grid() if cases is None else cases:
        if c["name"] in done or (only and only not in c["name"]):
            continue
        proc = subprocess.run([sys.executable, "-m", "mmpg.plan.validate", "--case", json.dumps(c)], env=env,
                              capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        row = dict(c, **json.loads(lines[-1])) if proc.returncode == 0 and lines else \
            dict(c, error=(proc.stderr.strip().splitlines() or ["?"])[-1][:300])
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(c["name"], row.get("peak_bytes", row.get("error")), flush=True)



def measure(case: dict) -> dict:
    """{"peak_bytes", "setup_bytes", "step_peaks", "seconds", ...} of one case in this process: the resident set's
    high-water over building the policy (and its reference copy), the DeepSpeed engine and one cold GRPO step (the
    trainer's own `GRPOStep`, its self-check off), less the resident set before them (torch, transformers and
    DeepSpeed imported, the process group up, and one small step of the same kind run and dropped: lazily imported
    modules, compiled ops and thread pools' buffers do not grow with the model or the batch). The probes are the
    bench's (`mmpg.bench.memory`: VmHWM after clear_refs, freed pages given back before each phase), so with
    MALLOC_MMAP_THRESHOLD_ 64 KiB the high-water follows live tensors rather than what glibc keeps of freed ones."""
    import torch

    from mmpg.bench import memory as probes
    from mmpg.bench.step import setup
    from mmpg.train.engine import prepare_deepspeed_env

    device = torch.device("cpu")
    torch.set_num_threads(int(case.get("threads", 1)))
    prepare_deepspeed_env("cpu")
    for name in ("deepspeed", "transformers"):  # imported before the baseline: their import is not the run's memory
        importlib.import_module(name)
    from mmpg import dist

    dist.init("cpu")
    warm(case, device)
    probes.release(device)
    base = probes.rss()
    if not probes.reset_hwm():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the CPU peak cannot be measured here")
    _, runner, info = setup(dict(case, release=True), device)
    after_setup = probes.rss() - base
    out = runner(memory=True)
    peak = probes.hwm() - base
    return {"peak_bytes": peak, "setup_bytes": after_setup, "step_peaks": out["peak_bytes"],
            "seconds": out["seconds"], "P": info["P"], "tokens": info["tokens"],
            "trainable_params": info["trainable_params"]}


def warm(case: dict, device) -> None:
    """One step of a small case of the same kind (same family, ZeRO stage, LoRA, checkpointing), dropped."""
    import gc

    from mmpg.bench.step import setup

    small = dict(case, P=64, S=4, G=2, spec=dict(case["spec"], hidden_size=32, num_layers=1,
                                                  intermediate_size=64, num_heads=4, num_kv_heads=2))
    _, runner, _ = setup(small, device)
    runner(memory=False)
    del runner
    gc.collect()

def report(path: Path) -> dict:
    """Predicted vs measured peaks: the grid, then the holdout cases, each with its median and worst |error|."""
    sets: dict[str, list] = {"grid": [], "holdout": []}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "peak_bytes" not in r or r["name"].endswith("-time"):
            continue
        pred = predict_case(r)
        sets["holdout" if r["name"].endswith("-holdout") else "grid"].append(
            {"name": r["name"], "measured_mb": r["peak_bytes"] / 2 ** 20, "predicted_mb": pred / 2 ** 20,
             "error": pred / r["peak_bytes"] - 1})
    summary = {}
    for key, rows in sets.items():
        errs = [abs(r["error"]) for r in rows]
        summary[key] = {"cases": len(rows), "median_abs_error": statistics.median(errs) if errs else None,
                        "worst_abs_error": max(errs) if errs else None, "rows": rows}
        print(f"{key:<44} {'measured MB':>12} {'predicted MB':>13} {'error':>8}")
        for r in rows:
            print(f"{r['name']:<44} {r['measured_mb']:>12.1f} {r['predicted_mb']:>13.1f} {r['error']:>+8.1%}")
        if errs:
            print(f"{len(rows)} cases: median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%}")
    return summary


def time_report(path: Path) -> dict | None:
    """Predicted naive/grouped step-time ratio (`mmpg.plan.timing` at this CPU's probed rates, utilisation 1) against
    the measured pair's; None until both are measured."""
    from mmpg.plan.timing import Throughput, cpu_throughput, step_seconds

    rows = {json.loads(ln)["variant"]: json.loads(ln) for ln in path.read_text().splitlines()
            if ln.strip() and json.loads(ln)["name"].endswith("-time") and "seconds" in json.loads(ln)}
    if set(rows) != {"naive", "mmpg"}:
        return None
    tflops, bw = cpu_throughput()
    hw = Throughput("cpu", tflops, bw, 1.0, 1.0)
    pred = {v: step_seconds(dataclasses.replace(case_recipe(rows[v]), cold=False), hw) for v in rows}
    phases = (("rollout", ("vision", "rollout_prefill", "rollout_decode")), ("logprob", ("reference",)),
              ("update", ("update",)), ("total", ("total",)))
    out = {"tflops": tflops, "bandwidth_tbs": bw, "phases": {}}
    print(f"{'phase':<10} {'measured naive/mmpg':>20} {'predicted':>10} {'error':>8}")
    for name, keys in phases:
        m = rows["naive"]["seconds"][name] / rows["mmpg"]["seconds"][name]
        p = sum(pred["naive"][k] for k in keys) / sum(pred["mmpg"][k] for k in keys)
        out["phases"][name] = {"measured": m, "predicted": p, "error": p / m - 1}
        print(f"{name:<10} {m:>20.2f} {p:>10.2f} {p / m - 1:>+8.1%}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measure", type=Path, help="JSON-lines file to append measurements to")
    p.add_argument("--time", action="store_true", help="with --measure: the step-time pair (naive, mmpg) instead")
    p.add_argument("--holdout", action="store_true", help="with --measure: the out-of-sample cases instead")
    p.add_argument("--only", default="", help="measure only cases whose name contains this")
    p.add_argument("--report", type=Path, help="JSON-lines file of measurements to compare with the plan")
    p.add_argument("--json", type=Path, default=None, help="write the comparison here")
    p.add_argument("--case", default=None, help="measure this one case (JSON) in this process, print one JSON line")
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(measure(json.loads(args.case))))
        return 0
    if args.measure:
        measure_all(args.measure, args.only, time_cases() if args.time else holdout() if args.holdout else None)
    if args.report:
        summary = report(args.report)
        summary["time"] = time_report(args.report)
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
