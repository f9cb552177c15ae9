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
ceiling) and "response_tokens". The rollout level's also hold B, the median prefill and decode seconds and the K/V
(`mmpg.bench.rollout` records them). Baselines and ceilings per level: `mmpg.bench.levels.LEVELS`.

A config whose repeated/naive variant would need more than `max_gb` (estimated before running) is skipped whole and
says so in its note. `in_process=True` runs the workers' `measure` here instead (fast, for smoke tests) and measures
no memory: a step there reuses pages that earlier variants and rounds left in the process, so its RSS growth reads 0
or a few pages, and the process high-water mark says nothing about one step. peak_MB and mem_ratio are then None
(n/a in the table), never a number that is not a measurement.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

from mmpg.bench import flops
from mmpg.bench.levels import LEVELS, ceiling_key
from mmpg.bench.memory import worker_env
from mmpg.models.geometry import from_config_dict


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
def shape_of(config: dict) -> dict:
    """Actual prompt shape and model dims (model/rollout levels) without building the model."""
    if config["level"] == "attention":
        return {"P": config["P"]}
    from mmpg.bench.batch import prompt_shape
    from mmpg.bench.model import model_config

    model_cfg, _ = model_config(config)
    shape = prompt_shape(config["P"], model_cfg, config.get("video"))
    shape["dims"] = from_config_dict(model_cfg.to_dict(), model_cfg.model_type)
    return shape


def naive_bytes(config: dict, shape: dict) -> float:
    """Rough peak of the repeated/naive variant (calibrated on CPU float32 runs within ~1.5x; used only to skip)."""
    P, S, G, b = shape["P"], config["S"], config["G"], 2 if config.get("dtype") in ("bfloat16", "float16") else 4
    tokens = G * (P + S)
    if config["level"] == "attention":
        return 3 * tokens * (config["heads"] + 2 * config["kv_heads"]) * config["head_dim"] * b
    d = shape["dims"]
    patches = G * shape.get("video_patches", 0)
    if config["level"] in ("rollout", "eval"):  # no backward: the K/V cache of B × G rows, the vision transients
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
    if config["level"] == "eval":  # Q queries answered once each: per-query prefills over the tree's (decode alike)
        Q, t = config.get("Q", 1), config.get("t", 32)
        base = flops.eval_flops_q(dims, "per_query", P, t, S, Q, **video)
        out.update(rho_lin=flops.rho_lin_q("per_query", P, t, 1, 1, Q), rho_eval=1.0)
        out.update(rho_eval_tree=base / flops.eval_flops_q(dims, "tree", P, t, S, Q, **video),
                   rho_lin_tree=Q * (P + t) / (P + Q * t))  # prompt tokens prefilled, per query over the tree
        out["rho_flops"] = 1.0
        return out
    if config["level"] != "step":
        out["rho_flops"] = flops.rho_flops(dims, P, S, G, **video)
        return out
    train_vision = not config.get("freeze_vision", True)
    if config.get("Q", 1) > 1:  # Q queries of one video: per-query grouping's ceilings, and the tree's (_tree)
        kw = dict(reference=config.get("beta", 0.04) > 0, train_vision=train_vision, **video)
        out.update(flops.ceilings_q(dims, "per_query", P, config["t"], S, G, config["Q"], **kw))
        out.update({f"{k}_tree": v for k, v in flops.ceilings_q(dims, "tree", P, config["t"], S, G, config["Q"],
                                                                 **kw).items()})
        return out
    out["rho_flops"] = flops.rho_flops(dims, P, S, G, train_vision=train_vision, **video)
    out["rho_rollout"] = flops.rho_rollout(dims, P, S, G, **video)
    out["rho_fwd"] = flops.rho_forward(dims, P, S, G, **video)
    out["rho_step"] = flops.rho_step(dims, P, S, G, reference=config.get("beta", 0.04) > 0, train_vision=train_vision,
                                     **video)
    return out


# ---- running ---------------------------------------------------------------------------------------------------------
def _measure(case: dict, warmup: int, repeats: int, timeout: float, in_process: bool) -> dict:
    """One (config, variant, round): `mmpg.bench.measure.measure` in a fresh process, or here without memory
    (in_process); a case with sp > 1 in sp processes (`mmpg.bench.sp.launch_ranks`)."""
    if case.get("sp", 1) > 1:
        if in_process:
            return {"error": "n/a: --sp > 1 runs sp worker processes (not --in-process)", "times": []}
        from mmpg.bench.sp import launch_ranks

        return launch_ranks(case, warmup, repeats, timeout)
    if in_process:
        from mmpg.bench.measure import measure

        return measure(case, warmup, repeats, memory=False)
    with tempfile.TemporaryDirectory(prefix="mmpg-bench-") as tmp:
        job, result = os.path.join(tmp, "case.json"), os.path.join(tmp, "result.json")
        with open(job, "w") as f:
            json.dump({"case": case, "warmup": warmup, "repeats": repeats}, f)
        try:
            proc = subprocess.run([sys.executable, "-m", "mmpg.bench.measure", job, result], timeout=timeout,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(case))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s", "times": []}
        if proc.returncode != 0 or not os.path.exists(result):
            tail = (proc.stdout or "").strip().splitlines()[-3:]
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            return {"error": f"worker {how}" + (f": {' | '.join(tail)}" if tail else ""), "times": []}
        with open(result) as f:
            return json.load(f)


def run_config(config: dict, *, rounds: int, warmup: int, repeats: int, timeout: float, max_gb: float,
               in_process: bool = False, log=print) -> list[dict]:
    """Measure every variant of one config; returns one row per variant (see `mmpg.bench.tables.COLUMNS`). A
    rollout config's rows also hold B and the median phases and K/V (`_rollout_rows`); its vllm variant gets a server
    here, once for every round (`mmpg.bench.rollout_vllm.start_server`), or a row saying why not."""
    level, shape = config["level"], shape_of(config)
    est_gb = naive_bytes(config, shape) / 1e9
    prompts = {"B": config.get("B", 1)} if level in ("rollout", "eval") else {}
    base = {"level": level, **prompts, "P": shape["P"], "S": config["S"], "G": config["G"], **queries_of(config),
            **ceilings(config, shape),
            "est_naive_GB": round(est_gb, 2), "config": config}
    variants = config["variants"]
    if est_gb > max_gb:
        note = f"skipped: naive needs ~{est_gb:.0f} GB > {max_gb:g} GB"
        return [dict(base, variant=v, note=note) for v in variants]
    results, skipped, served = {v: [] for v in variants}, {}, None
    where = f"{level} B={prompts['B']}" if prompts else level
    with contextlib.ExitStack() as stack:  # the vLLM server (if any) is stopped however this ends
        if "vllm" in variants:
            from mmpg.bench import rollout_vllm

            served, skipped["vllm"] = rollout_vllm.start_server(config, shape["P"], stack, log=log)
        for r in range(rounds):
            for label in variants[r % len(variants):] + variants[: r % len(variants)]:
                if skipped.get(label):
                    continue
                log(f"  {where} P={shape['P']} S={config['S']} G={config['G']} {label} (round {r + 1}/{rounds})")
                case = case_for(config, label)
                if label == "vllm":
                    case["vllm_url"] = served["url"]
                res = _measure(case, warmup, repeats, timeout, in_process)
                results[label].append(res)
                if res.get("error"):
                    log(f"    -> {res['error']}")
        if served is not None and any(r.get("error") for r in results["vllm"]):
            served["keep_log"] = True  # read when the server stops, on the way out of the stack
    rows = [dict(base, variant=v, note=skipped[v]) if skipped.get(v) else
            dict(base, variant=v, **_aggregate(results[v])) for v in variants]
    if level == "rollout":
        _rollout_rows(rows, results, skipped, served, repeats)
    if level == "eval":
        _eval_rows(rows, results, repeats)
    return rows


def _eval_rows(rows: list[dict], results: dict, repeats: int) -> None:
    """The eval rows (in place) with the prefill/decode medians, what the engine prefilled (its last_stats) and
    same_answers: how many of the B·Q answers are identical to hf_generate's (None without an hf_generate row)."""
    def answers(variant):
        return next((r["info"]["answers"] for r in results.get(variant, []) if "answers" in (r.get("info") or {})),
                    None)

    reference = answers("hf_generate")
    for row in rows:
        row.update(_phase_medians(results[row["variant"]], repeats))
        last = next((p for r in results[row["variant"]] for p in (r.get("info") or {}).get("phases", [])[-1:]), {})
        row.update({k: last.get(k) for k in ("prefixes", "prefix_tokens")})
        mine = answers(row["variant"])
        row["same_answers"] = (sum(a == b for a, b in zip(mine, reference))
                               if mine is not None and reference is not None else None)


def _median(values, unit: float = 1):
    """The median of the values that are not None, in `unit`s (2**20: bytes -> MB); None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) / unit if values else None


def _aggregate(runs: list[dict]) -> dict:
    errors = [r["error"] for r in runs if r.get("error")]
    if errors:
        return {"note": errors[0]}
    times = [t for r in runs for t in r["times"]]
    out = {"time_s": _median(times), "times": times, "cold_s": [r["cold_s"] for r in runs],
           "peak_MB": _median((r.get("peak_bytes") for r in runs), 2**20),
           "mem_method": runs[0].get("mem_method"), "tokens": runs[0]["info"].get("tokens"), "note": ""}
    if any("phase_times" in r for r in runs):
        out["response_tokens"] = runs[0]["info"].get("response_tokens")
        for key in ("rollout_stats", "shared_prompts", "vision_calls", "kv_bytes",  # what the step's work was
                    "row_tokens", "threads", "trainable_params"):  # and what `mmpg.bench.sp` needs
            if key in runs[0]["info"]:
                out[key] = runs[0]["info"][key]
        if isinstance(out.get("row_tokens"), int):  # one process: one rank
            out["row_tokens"] = [out["row_tokens"]]
        out["phases"] = _aggregate_phases(runs)
        out["rank_phase_peak_MB"] = _rank_peaks(runs)  # per rank (max over ranks: the phases' peak_MB)
    return out


def _aggregate_phases(runs: list[dict]) -> dict:
    """{phase: {"time_s": median, "times", "peak_MB": median over rounds}} for the step level (total included)."""
    from mmpg.bench.step import PHASES

    phases = {}
    for name in (*PHASES, "total"):
        times = [t[name] for r in runs for t in r["phase_times"]]
        phases[name] = {"time_s": _median(times), "times": times,
                        "peak_MB": _median(((r.get("phase_peak_bytes") or {}).get(name) for r in runs), 2**20)}
    return phases


def _rank_peaks(runs: list[dict]) -> dict:
    """{phase: [median over rounds of each rank's peak, MB]}: one rank for one process, sp for `mmpg.bench.sp`."""
    per_run = [r.get("rank_phase_peak_bytes") or {k: [v] for k, v in (r.get("phase_peak_bytes") or {}).items()}
               for r in runs]
    names = per_run[0] if per_run else {}
    return {name: [_median((p.get(name, [])[i] if i < len(p.get(name, [])) else None for p in per_run), 2**20)
                   for i in range(len(names[name]))] for name in names}


def _rollout_rows(rows: list[dict], results: dict, skipped: dict, served: dict | None, repeats: int) -> list[dict]:
    """The rollout rows (in place) with the median phases and K/V of the variants that ran (`mmpg.bench.rollout`), the
    vllm row's server facts (`served`: `mmpg.bench.rollout_vllm.start_server`) and kv_ratio: the copy path's K/V over this
    row's (the cascade row's is to be compared with ρ_lin)."""
    for row in rows:
        if not skipped.get(row["variant"]):
            row.update(_phase_medians(results[row["variant"]], repeats))
        if row["variant"] == "vllm":
            _vllm_row(row, served)
    copy = next((r for r in rows if r["variant"] in ("mmpg:copy", "mmpg") and r.get("kv_MB")), None)
    for row in rows:
        row["kv_ratio"] = copy["kv_MB"] / row["kv_MB"] if copy and row.get("kv_MB") else None
    return rows


def _vllm_row(row: dict, served: dict | None) -> None:
    """The worker's memory is not the server's: no peak for the vllm row; the server's facts beside it."""
    row["peak_MB"] = None
    if row.get("time_s") is not None:
        row["mem_method"] = "not measured (the vLLM server's own process)"
    if served is not None:
        row["vllm_server"] = {k: served.get(k) for k in ("url", "start_s", "checkpoint")}
        if row.get("note") and served.get("log") and served.get("keep_log"):
            row["note"] += f" (server log: {served['log']})"


def _phase_medians(runs: list[dict], repeats: int) -> dict:
    """Median prefill/decode seconds over the timed steps (the last `repeats` of each process) and the K/V MB."""
    timed = [p for r in runs if not r.get("error") for p in (r.get("info") or {}).get("phases", [])[-repeats:]]
    return {"prefill_s": _median(p.get("prefill_s") for p in timed),
            "decode_s": _median(p.get("decode_s") for p in timed),
            "kv_MB": _median((p.get("kv_bytes") for p in timed), 2**20)}


def queries_of(config: dict) -> dict:
    """{"Q", "t"} of a config with several queries of one video, else {} (rows of one query stay as they were)."""
    return {"Q": config["Q"], "t": config["t"]} if config.get("Q", 1) > 1 else {}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Speed-up, memory ratio and % of the ceiling against the config's baseline row (in place; returns rows)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["level"], row["P"], row["S"], row["G"], json.dumps(row["config"], sort_keys=True)),
                          []).append(row)
    for group in groups.values():
        base = next((r for r in group if split_variant(r["variant"])[0] == LEVELS[r["level"]].baseline), None)
        for row in group:
            row["speedup"] = row["mem_ratio"] = row["pct_ceiling"] = None
            if base is None or row.get("time_s") is None or base.get("time_s") is None:
                continue
            row["speedup"] = base["time_s"] / row["time_s"]
            if row is not base:
                row["pct_ceiling"] = 100 * row["speedup"] / row[ceiling_key(row, LEVELS[row["level"]].ceiling)]
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
        phase["ceiling"] = row.get(ceiling_key(row, key)) if key else None
        phase["speedup"] = phase["pct_ceiling"] = phase["mem_ratio"] = None
        if phase.get("time_s") and ref.get("time_s"):
            phase["speedup"] = ref["time_s"] / phase["time_s"]
            if row is not base and phase["ceiling"]:
                phase["pct_ceiling"] = 100 * phase["speedup"] / phase["ceiling"]
        if phase.get("peak_MB") and ref.get("peak_MB"):
            phase["mem_ratio"] = ref["peak_MB"] / phase["peak_MB"]
