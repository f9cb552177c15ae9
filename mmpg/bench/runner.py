"""Run a benchmark plan: configs × variants, interleaved, each measurement in a fresh process; rows with ceilings.

Order and repeats (what "interleaved A/B/C with warm-up and medians" means here):

    for each config:
        round 0:  A  B  C        one fresh process per (variant, round): setup, cold step (memory, warm-up),
        round 1:  B  C  A        `warmup - 1` more steps, `repeats` timed steps
        round 2:  C  A  B        the order rotates each round

time_s = median of the rounds × repeats timed steps; peak memory = median over rounds of the cold step's peak. The
interleaving is across processes, so slow drift on a shared machine (other jobs starting or stopping) spreads over
all variants instead of landing on whichever ran last; repeats inside one process run back to back.

The step level (`mmpg.bench.step`) times its own phases inside each step: its rows also hold "phases" (per phase the
median time, the median over rounds of the cold step's peak, the speed-up, memory ratio and % of the phase's own
ceiling) and "response_tokens".

A config whose repeated/naive variant would need more than `max_gb` (estimated before running) is skipped whole and
says so in its note. `in_process=True` runs the workers' `measure` here instead (fast, for smoke tests) and measures
no memory: a step there reuses pages that earlier variants and rounds left in the process, so its RSS growth reads 0
or a few pages, and the process high-water mark says nothing about one step. peak_MB and mem_ratio are then None
(n/a in the table), never a number that is not a measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from mmpg.bench import flops

BASELINE = {"attention": "naive", "model": "repeated", "rollout": "hf_generate", "step": "naive"}


def split_variant(label: str) -> tuple[str, str | None]:
    """'mmpg:flex' -> ('mmpg', 'flex'); 'naive' -> ('naive', None)."""
    name, _, backend = label.partition(":")
    return name, backend or None


def case_for(config: dict, label: str) -> dict:
    name, backend = split_variant(label)
    case = {k: v for k, v in config.items() if k != "variants"}
    case["variant"] = name
    if backend:
        case["backend"] = backend
    return case


# ---- estimates and ceilings, before anything runs ------------------------------------------------------------------
def dtype_bytes(config: dict) -> int:
    return 2 if config.get("dtype") in ("bfloat16", "float16") else 4


def shape_of(config: dict) -> dict:
    """Actual prompt shape and model dims (model/rollout levels) without building the model."""
    if config["level"] == "attention":
        return {"P": config["P"]}
    from mmpg.bench.model import model_config, prompt_shape

    model_cfg, _ = model_config(config)
    shape = prompt_shape(config["P"], model_cfg, config.get("video"))
    shape["dims"] = flops.dims_from_config(model_cfg)
    return shape


def naive_bytes(config: dict, shape: dict) -> float:
    """Rough peak of the repeated/naive variant (calibrated on CPU float32 runs within ~1.5x; used only to skip)."""
    P, S, G, b = shape["P"], config["S"], config["G"], dtype_bytes(config)
    tokens = G * (P + S)
    if config["level"] == "attention":
        return 3 * tokens * (config["heads"] + 2 * config["kv_heads"]) * config["head_dim"] * b
    d = shape["dims"]
    patches = G * shape.get("video_patches", 0)
    if config["level"] == "rollout":  # no backward: the K/V cache of B × G rows, and the vision tower's transients
        tokens, patches = tokens * config.get("B", 1), patches * config.get("B", 1)
        return tokens * d.layers * 2 * d.kv_heads * d.d * b + (patches * 8 * d.vision.hidden * b if d.vision else 0)
    per_token_layer = d.hidden if config.get("grad_ckpt") else 16 * d.hidden + 4 * d.intermediate + 2 * d.heads * d.d
    per_patch_block = (1 if config.get("grad_ckpt") else 12) * d.vision.hidden if d.vision else 0
    return (tokens * d.layers * per_token_layer + patches * (d.vision.depth if d.vision else 0) * per_patch_block) * b


def ceilings(config: dict, shape: dict) -> dict:
    """rho_lin, rho_attn, rho_flops; the step level adds one per phase (`mmpg.bench.step.PHASE_CEILINGS`): rho_rollout,
    rho_fwd (reference logprobs), rho_step (the whole step), and its rho_flops is the update's (vision frozen)."""
    P, S, G = shape["P"], config["S"], config["G"]
    out = {"rho_lin": flops.rho_lin(P, S, G), "rho_attn": flops.rho_attn(P, S, G)}
    if config["level"] == "attention":
        out["rho_flops"] = out["rho_attn"]  # one attention layer: its FLOPs are the attention FLOPs
        return out
    dims, video = shape["dims"], {"video_patches": shape.get("video_patches", 0),
                                  "frame_patches": shape.get("frame_patches", 0)}
    if config["level"] != "step":
        out["rho_flops"] = flops.rho_flops(dims, P, S, G, **video)
        return out
    train_vision = not config.get("freeze_vision", True)
    out["rho_flops"] = flops.rho_flops(dims, P, S, G, train_vision=train_vision, **video)
    out["rho_rollout"] = flops.rho_rollout(dims, P, S, G, **video)
    out["rho_fwd"] = flops.rho_forward(dims, P, S, G, **video)
    out["rho_step"] = flops.rho_step(dims, P, S, G, reference=config.get("beta", 0.04) > 0, train_vision=train_vision,
                                     **video)
    return out


# ---- running ---------------------------------------------------------------------------------------------------------
def _spawn(case: dict, warmup: int, repeats: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="mmpg-bench-") as tmp:
        job, result = os.path.join(tmp, "case.json"), os.path.join(tmp, "result.json")
        with open(job, "w") as f:
            json.dump({"case": case, "warmup": warmup, "repeats": repeats}, f)
        try:
            proc = subprocess.run([sys.executable, "-m", "mmpg.bench.worker", job, result], timeout=timeout,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s", "times": []}
        if proc.returncode != 0 or not os.path.exists(result):
            tail = (proc.stdout or "").strip().splitlines()[-3:]
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            return {"error": f"worker {how}" + (f": {' | '.join(tail)}" if tail else ""), "times": []}
        with open(result) as f:
            return json.load(f)


def _measure(case: dict, warmup: int, repeats: int, timeout: float, in_process: bool) -> dict:
    if in_process:
        from mmpg.bench.worker import measure

        return measure(case, warmup, repeats, memory=False)
    return _spawn(case, warmup, repeats, timeout)


def run_config(config: dict, *, rounds: int, warmup: int, repeats: int, timeout: float, max_gb: float,
               in_process: bool = False, log=print) -> list[dict]:
    """Measure every variant of one config; returns one row per variant (see `report.COLUMNS`)."""
    shape = shape_of(config)
    ceil = ceilings(config, shape)
    est_gb = naive_bytes(config, shape) / 1e9
    base = {"level": config["level"], "P": shape["P"], "S": config["S"], "G": config["G"], **ceil,
            "est_naive_GB": round(est_gb, 2), "config": config}
    variants = config["variants"]
    if est_gb > max_gb:
        note = f"skipped: naive needs ~{est_gb:.0f} GB > {max_gb:g} GB"
        return [dict(base, variant=v, note=note) for v in variants]
    results = {v: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for label in order:
            log(f"  {config['level']} P={shape['P']} S={config['S']} G={config['G']} {label} (round {r + 1}/{rounds})")
            res = _measure(case_for(config, label), warmup, repeats, timeout, in_process)
            results[label].append(res)
            if res.get("error"):
                log(f"    -> {res['error']}")
    return [dict(base, variant=v, **_aggregate(results[v])) for v in variants]


def _aggregate(runs: list[dict]) -> dict:
    errors = [r["error"] for r in runs if r.get("error")]
    if errors:
        return {"note": errors[0]}
    times = [t for r in runs for t in r["times"]]
    peaks = [r["peak_bytes"] for r in runs if r.get("peak_bytes") is not None]
    out = {"time_s": statistics.median(times) if times else None, "times": times,
           "cold_s": [r["cold_s"] for r in runs], "peak_MB": statistics.median(peaks) / 2**20 if peaks else None,
           "mem_method": runs[0].get("mem_method"), "tokens": runs[0]["info"].get("tokens"), "note": ""}
    if any("phase_times" in r for r in runs):
        out["response_tokens"] = runs[0]["info"].get("response_tokens")
        out["phases"] = _aggregate_phases(runs)
    return out


def _aggregate_phases(runs: list[dict]) -> dict:
    """{phase: {"time_s": median, "times", "peak_MB": median over rounds}} for the step level (total included)."""
    from mmpg.bench.step import PHASES

    phases = {}
    for name in (*PHASES, "total"):
        times = [t[name] for r in runs for t in r["phase_times"]]
        peaks = [r["phase_peak_bytes"][name] for r in runs
                 if (r.get("phase_peak_bytes") or {}).get(name) is not None]
        phases[name] = {"time_s": statistics.median(times) if times else None, "times": times,
                        "peak_MB": statistics.median(peaks) / 2**20 if peaks else None}
    return phases


def add_ratios(rows: list[dict]) -> list[dict]:
    """Speed-up, memory ratio and % of the ceiling against the config's baseline row (in place; returns rows)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["level"], row["P"], row["S"], row["G"], json.dumps(row["config"], sort_keys=True)),
                          []).append(row)
    for group in groups.values():
        base = next((r for r in group if split_variant(r["variant"])[0] == BASELINE[r["level"]]), None)
        for row in group:
            row["speedup"] = row["mem_ratio"] = row["pct_ceiling"] = None
            if base is None or row.get("time_s") is None or base.get("time_s") is None:
                continue
            row["speedup"] = base["time_s"] / row["time_s"]
            ceiling = {"rollout": "rho_lin", "step": "rho_step"}.get(row["level"], "rho_flops")
            if row is not base:
                row["pct_ceiling"] = 100 * row["speedup"] / row[ceiling]
            if row.get("peak_MB") and base.get("peak_MB"):
                row["mem_ratio"] = base["peak_MB"] / row["peak_MB"]
            if row.get("phases") and base.get("phases"):
                _phase_ratios(row, base)
    return rows


def _phase_ratios(row: dict, base: dict) -> None:
    """Speed-up, memory ratio and % of its own ceiling per phase of a step-level row (in place)."""
    from mmpg.bench.step import PHASE_CEILINGS

    for name, phase in row["phases"].items():
        ref, key = base["phases"].get(name, {}), PHASE_CEILINGS.get(name)
        phase["ceiling"] = row.get(key) if key else None
        phase["speedup"] = phase["pct_ceiling"] = phase["mem_ratio"] = None
        if phase.get("time_s") and ref.get("time_s"):
            phase["speedup"] = ref["time_s"] / phase["time_s"]
            if row is not base and phase["ceiling"]:
                phase["pct_ceiling"] = 100 * phase["speedup"] / phase["ceiling"]
        if phase.get("peak_MB") and ref.get("peak_MB"):
            phase["mem_ratio"] = ref["peak_MB"] / phase["peak_MB"]
