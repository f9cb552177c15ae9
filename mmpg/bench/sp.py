"""`mmpg bench --levels step --sp N`: one GRPO step with the packed row spread over N ranks, beside sp = 1.

Each (config, variant, round) with sp = N > 1 runs as N gloo processes (`launch_ranks`: torchrun, OMP_NUM_THREADS =
cores / N each, so sp 1 and sp N compute on the same cores). Every rank runs the trainer's whole step
(`mmpg.bench.step`, the reference's and the update's `grouped_logprobs` with `sequence_group`), measures its own
peaks (`mmpg.bench.memory`) and writes its own file; `merge` keeps, per phase, the largest peak over the ranks (and
each rank's) and the slowest rank's time. The repeated ("naive") forward does not spread: an sp = 1 row only.

Ceilings (`ceilings`), per rank, from the sp = 1 row of the same config:

    memory   F + (M_1 - F) / N      M_1: the phase's sp = 1 peak; F: what every rank holds whole, 12 B per trainable
                                    parameter in the update (fp32 gradient, AdamW's m and v), 0 in the reference
                                    forward. The rollout is not split (one prompt): its ceiling is M_1.
    time     sum over phases of t_1 · (c_1 / c_N) · f      c: threads per process; f = 1/N for the reference and
                                    update forwards, ceil(B/N)/B for the rollout, 1 for the rest: ~t_1 on one
                                    machine (c_1 = N c_N: SP buys memory there), t_1 / N for the forwards on N devices.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile

from mmpg.bench.memory import worker_env
from mmpg.bench.step import PHASES

SPLIT = {"logprob": True, "update": True}  # phases whose work is 1/sp per rank (the rollout: by prompt)
FIXED_BYTES_PER_PARAM = {"update": 12, "total": 12}  # fp32 gradient + AdamW m, v: whole on every rank


def launch_ranks(case: dict, warmup: int, repeats: int, timeout: float) -> dict:
    """One (config, variant, round) as case["sp"] processes; returns `merge` of their results (or an error)."""
    from mmpg.bench.measure import rank_path

    sp = case["sp"]
    env = dict(worker_env(case), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // sp)))
    with tempfile.TemporaryDirectory(prefix="mmpg-bench-sp-") as tmp:
        job, result = os.path.join(tmp, "case.json"), os.path.join(tmp, "result.json")
        with open(job, "w") as f:
            json.dump({"case": case, "warmup": warmup, "repeats": repeats}, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp),
               "-m", "mmpg.bench.measure", job, result]
        # a session of its own: on a timeout the whole group (torchrun and its ranks) is killed, not torchrun alone
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"error": f"timed out after {timeout:.0f} s ({sp} ranks)", "times": []}
        parts = []
        for r in range(sp):
            path = rank_path(result, r)
            parts.append(json.load(open(path)) if os.path.exists(path) else None)
    failed = [(r, p) for r, p in enumerate(parts) if p is None or p.get("error")]
    if failed or proc.returncode != 0:
        r, p = failed[0] if failed else (0, None)
        tail = " | ".join((output or "").strip().splitlines()[-3:])
        why = p["error"] if p else f"rank {r} wrote nothing (torchrun exit {proc.returncode}): {tail}"
        return {"error": f"rank {r}: {why}" if p else why, "times": []}
    return merge(parts)


def merge(parts: list[dict]) -> dict:
    """The ranks' results as one worker result: per timed step and phase the slowest rank's seconds, per phase the
    largest peak; each rank's peaks kept under rank_peak_bytes / rank_phase_peak_bytes (rank order)."""
    first = parts[0]
    out = dict(first, info=dict(first["info"], row_tokens=[p["info"].get("row_tokens") for p in parts]))
    out["times"] = [max(ts) for ts in zip(*(p["times"] for p in parts))]
    out["cold_s"] = max(p["cold_s"] for p in parts)
    out["phase_times"] = [{k: max(step[k] for step in steps) for k in steps[0]}
                          for steps in zip(*(p["phase_times"] for p in parts))]
    peaks = [p.get("phase_peak_bytes") or {} for p in parts]
    out["rank_phase_peak_bytes"] = {k: [pk.get(k) for pk in peaks] for k in peaks[0]}
    out["phase_peak_bytes"] = {k: _max(v) for k, v in out["rank_phase_peak_bytes"].items()}
    out["rank_peak_bytes"] = [p.get("peak_bytes") for p in parts]
    out["peak_bytes"] = _max(out["rank_peak_bytes"])
    return out


def _max(values):
    seen = [v for v in values if v is not None]
    return max(seen) if seen else None


def _phase_fraction(name: str, sp: int, prompts: int) -> float:
    """The share of a phase's sp = 1 work that one of sp ranks does."""
    if SPLIT.get(name):
        return 1 / sp
    if name == "rollout":
        return math.ceil(prompts / sp) / prompts
    return 1.0


def sp_of(row: dict) -> int:
    return (row.get("config") or {}).get("sp", 1)


def ceilings(one: dict, row: dict) -> dict:
    """{phase: {"mem_MB", "time_s"}} ceilings of an sp = N row from the sp = 1 row `one` of its config (module
    docstring); "total" included. Rows as `mmpg.bench.runner` aggregates them (phases, threads, trainable_params)."""
    sp, prompts = sp_of(row), row.get("Q") or 1
    speed = (one.get("threads") or 1) / (row.get("threads") or 1)  # c_1 / c_N
    out, phases1 = {}, one.get("phases") or {}
    params_mb = (one.get("trainable_params") or 0) / 2**20
    for name in PHASES:
        p1 = phases1.get(name) or {}
        mem1, t1 = p1.get("peak_MB"), p1.get("time_s")
        split = SPLIT.get(name) or (name == "rollout" and prompts >= sp)
        fixed = FIXED_BYTES_PER_PARAM.get(name, 0) * params_mb
        mem = (fixed + (mem1 - fixed) / sp if split else mem1) if mem1 is not None else None
        out[name] = {"mem_MB": mem, "time_s": t1 * speed * _phase_fraction(name, sp, prompts) if t1 else None}
    t1_total = (phases1.get("total") or {}).get("time_s")
    rest = t1_total - sum((phases1.get(n) or {}).get("time_s") or 0 for n in PHASES) if t1_total else 0
    times = [out[n]["time_s"] for n in PHASES]
    mems = [out[n]["mem_MB"] for n in PHASES if out[n]["mem_MB"] is not None]
    out["total"] = {"time_s": sum(times) + rest * speed if None not in times else None,
                    "mem_MB": max(mems) if mems else None}
    return out


COLUMNS = [  # (header, width, format)
    ("P", 6, "{}"), ("variant", 7, "{}"), ("sp", 2, "{}"), ("row/rank", 8, "{}"), ("upd_MB", 7, "{:.0f}"),
    ("ceil", 6, "{:.0f}"), ("x sp1", 5, "{:.2f}"), ("ceil", 5, "{:.2f}"), ("step_MB", 7, "{:.0f}"),
    ("ceil", 6, "{:.0f}"), ("upd_s", 7, "{:.2f}"), ("ceil", 7, "{:.2f}"), ("step_s", 7, "{:.2f}"),
    ("ceil", 7, "{:.2f}"), ("ranks' upd_MB", 13, "{}")]
CAPTION = [
    "sequence parallelism: one GRPO step of the trainer (GRPOStep: rollout, reward, reference logprobs, update), the",
    "  reference's and the update's grouped forward spread over sp gloo ranks (`sequence_group`); per rank, the max",
    "  over ranks: upd_MB the update phase's peak (grouped forward + backward + AdamW), step_MB the step's, s the",
    "  slowest rank's seconds. row/rank: packed-row tokens a rank holds. x sp1: this peak over the sp 1 peak.",
    "  ceil: memory F + (M_1 - F) / sp with F = 12 B x trainable parameters (gradient, AdamW m, v: whole on every",
    "  rank), the rollout unsplit (1 prompt); time: sp 1's phases x (threads at sp 1 / threads per rank) x the",
    "  share of each phase a rank does (1/sp for the forwards): ~sp 1's time when the ranks share its cores.",
    "  naive (the repeated forward) does not spread over ranks: sp 1 only."]


def _cells(values) -> str:
    out = []
    for (name, width, fmt), value in zip(COLUMNS, values):
        text = "-" if value is None else fmt.format(value)
        out.append(text.ljust(width) if name == "variant" else text.rjust(width))
    return "  ".join(out).rstrip()


def _line(row: dict, one: dict | None) -> str:
    phases = row.get("phases") or {}
    upd, tot = phases.get("update") or {}, phases.get("total") or {}
    ceil = ceilings(one, row) if one is not None and sp_of(row) > 1 else {}
    cu, ct = ceil.get("update") or {}, ceil.get("total") or {}
    base = ((one or {}).get("phases") or {}).get("update", {}).get("peak_MB") if sp_of(row) > 1 else None
    ratio = upd["peak_MB"] / base if base and upd.get("peak_MB") else None
    ranks = ((row.get("rank_phase_peak_MB") or {}).get("update")) or []
    tokens = row.get("row_tokens")
    return _cells([row["P"], row["variant"], sp_of(row), max(tokens) if tokens else None, upd.get("peak_MB"),
                   cu.get("mem_MB"), ratio, cu["mem_MB"] / base if base and cu.get("mem_MB") else None,
                   tot.get("peak_MB"), ct.get("mem_MB"), upd.get("time_s"), cu.get("time_s"), tot.get("time_s"),
                   ct.get("time_s"), "/".join("-" if m is None else f"{m:.0f}" for m in ranks) or None]) + (
        f"  {row['note']}" if row.get("note") else "")


def sp_table(rows: list[dict]) -> str:
    """The step rows of every config that ran at some sp > 1: naive and mmpg at sp 1, mmpg at sp N, with ceilings."""
    steps = [r for r in rows if r["level"] == "step"]
    key = lambda r: (r["P"], r["S"], r["G"], r.get("Q", 1))  # noqa: E731
    configs = sorted({key(r) for r in steps if sp_of(r) > 1})
    if not configs:
        return ""
    header = "  ".join(h.ljust(w) if h == "variant" else h.rjust(w) for h, w, _ in COLUMNS)
    lines = CAPTION + [header, "-" * len(header)]
    for k in configs:
        group = sorted((r for r in steps if key(r) == k), key=lambda r: (sp_of(r), r["variant"] != "naive"))
        one = next((r for r in group if sp_of(r) == 1 and r["variant"] == "mmpg"), None)
        for row in group:
            lines.append(_line(row, one if row["variant"] == "mmpg" else None))
        for sp in sorted({sp_of(r) for r in group if sp_of(r) > 1}):
            if any(r["variant"] == "naive" for r in group):
                lines.append(_cells([k[0], "naive", sp] + [None] * (len(COLUMNS) - 3))
                             + "  n/a: the repeated forward does not spread over ranks")
        lines.append("")
    return "\n".join(lines).rstrip()
