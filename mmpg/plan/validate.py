"""Validate `mmpg plan --device cpu` against measured CPU peaks: predicted vs measured, median and worst error.

    python -m mmpg.plan.validate --measure results/plan_cpu.jsonl     # one process per case (minutes each)
    python -m mmpg.plan.validate --report results/plan_cpu.jsonl [--json results/plan_cpu.json]

The grid is a fractional design over the factors the plan's memory model has terms for: two model sizes (the bench's
tiny model, LM hidden 64 x 2 layers, and its cpu-targets model, hidden 256 x 4 layers), ZeRO 0/2/3, LoRA off/r 8
(then the reference is the policy with its adapters off), G 4/16, P ~1k/8k (mostly video tokens), gradient
checkpointing off/on, grouped (mmpg) and naive (generate + repeated forward); S 64, float32, the KL term on
(beta 0.04), the vision tower frozen. Every level of every factor appears; the naive layout is left out at P 8k with
G 16 (16 rows of 8k tokens: minutes and gigabytes on a CPU) and the small model at P 8k naive. Each case is measured
in its own process (`mmpg.plan.measure`) so that no case sees another's pages. `--measure` appends one JSON line per
case as it finishes (a killed run keeps what it measured; a rerun skips the cases already in the file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

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


def measure_all(path: Path, only: str = "") -> None:
    done = {json.loads(line)["name"] for line in path.read_text().splitlines() if line.strip()} if path.exists() else set()
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024), OMP_NUM_THREADS="1")
    for c in grid():
        if c["name"] in done or (only and only not in c["name"]):
            continue
        proc = subprocess.run([sys.executable, "-m", "mmpg.plan.measure", json.dumps(c)], env=env,
                              capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        row = dict(c, **json.loads(lines[-1])) if proc.returncode == 0 and lines else \
            dict(c, error=(proc.stderr.strip().splitlines() or ["?"])[-1][:300])
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(c["name"], row.get("peak_bytes", row.get("error")), flush=True)


def report(path: Path, out_json: Path | None = None) -> dict:
    from mmpg.plan.cpu import predict_case

    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "peak_bytes" not in r:
            continue
        pred = predict_case(r)
        rows.append({"name": r["name"], "measured_mb": r["peak_bytes"] / 2 ** 20, "predicted_mb": pred / 2 ** 20,
                     "error": pred / r["peak_bytes"] - 1})
    errs = [abs(r["error"]) for r in rows]
    summary = {"cases": len(rows), "median_abs_error": statistics.median(errs) if errs else None,
               "worst_abs_error": max(errs) if errs else None, "rows": rows}
    print(f"{'case':<44} {'measured MB':>12} {'predicted MB':>13} {'error':>8}")
    for r in rows:
        print(f"{r['name']:<44} {r['measured_mb']:>12.1f} {r['predicted_mb']:>13.1f} {r['error']:>+8.1%}")
    if errs:
        print(f"{len(rows)} cases: median |error| {summary['median_abs_error']:.1%}, worst {summary['worst_abs_error']:.1%}")
    if out_json:
        out_json.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measure", type=Path, help="JSON-lines file to append measurements to")
    p.add_argument("--only", default="", help="measure only cases whose name contains this")
    p.add_argument("--report", type=Path, help="JSON-lines file of measurements to compare with the plan")
    p.add_argument("--json", type=Path, default=None, help="write the comparison here")
    args = p.parse_args(argv)
    if args.measure:
        measure_all(args.measure, args.only)
    if args.report:
        report(args.report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
