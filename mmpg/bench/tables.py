"""The printed tables and the JSON file of a benchmark run.

Columns (one row per config × variant):
    time_s     median step time (forward + backward; rollout: generation)
    speedup    baseline time / this time            baseline: naive (attention), repeated (model), hf_generate
    %ceil      speedup / ceiling × 100              ceiling: ρ_attn (attention), ρ_flops (model), ρ_lin (rollout)
    peak_MB    peak extra memory of one step (see `mmpg.bench.measure`); n/a where not measured (--in-process) or
               not measurable (the step's RSS did not grow)
    mem_ratio  baseline peak / this peak            compare with ρ_lin, the token ratio; n/a without both peaks
    rho_*      the ceilings of `mmpg.bench.flops`

Step level (`--levels step`): one line per phase (rollout, reward, logprob, update, total) of each variant, with
    ceil       the phase's own ceiling: ρ_rollout, none (reward), ρ_fwd, ρ_flops (update), ρ_step (total); see
               `mmpg.bench.flops`; %ceil = speedup / ceil × 100
    peak_MB    the phase's high-water minus the memory in use when the step began (`mmpg.bench.step`)
The JSON row of a variant holds the same numbers under "phases" (its time_s, speedup and peak_MB are the total's).

Rollout level: a second table (`rollout_table`) adds B (prompts per step), prefill_s, decode_s, kv_MB and kv_ratio
(the copy path's K/V over this row's), from `mmpg.bench.rollout`.

%ceil can pass 100 on a CPU with a small model: there the repeated baseline is partly memory-bound (norms,
activations, copies and the allocator scale with tokens, i.e. with ρ_lin, not with FLOPs), so the FLOPs ceiling is
not a wall-clock ceiling; ρ_lin bounds that part.
"""

from __future__ import annotations

import datetime
import json
import os
import platform

import torch

COLUMNS = [  # (key, header, width, format)
    ("level", "level", 9, "{}"), ("P", "P", 6, "{}"), ("S", "S", 4, "{}"), ("G", "G", 3, "{}"),
    ("variant", "variant", 11, "{}"), ("time_s", "time_s", 8, "{:.3f}"), ("speedup", "speedup", 7, "{:.2f}"),
    ("pct_ceiling", "%ceil", 6, "{:.0f}"), ("peak_MB", "peak_MB", 8, "{:.0f}"), ("mem_ratio", "mem_ratio", 9, "{:.2f}"),
    ("rho_lin", "rho_lin", 7, "{:.2f}"), ("rho_attn", "rho_attn", 8, "{:.2f}"), ("rho_flops", "rho_flops", 9, "{:.2f}"),
]


STEP_COLUMNS = COLUMNS[:4] + [("Q", "Q", 2, "{}"), COLUMNS[4], ("phase", "phase", 7, "{}")] + COLUMNS[5:7] \
    + [("ceiling", "ceil", 5, "{:.2f}")] + COLUMNS[7:]
LEFT = ("level", "variant", "phase")  # left-aligned columns

MEMORY_COLUMNS = ("peak_MB", "mem_ratio")


def _cell(row: dict, key: str, width: int, fmt: str, na=MEMORY_COLUMNS) -> str:
    value = row.get(key)
    if value is None:  # a row that ran but has no memory numbers says so; "-" is for what does not apply
        text = "n/a" if key in na and row.get("time_s") is not None else "-"
    else:
        text = fmt.format(value)
    return text.rjust(width) if key not in LEFT else text.ljust(width)


def format_table(rows: list[dict]) -> str:
    """Fixed-width table; a row's note (skipped, OOM, n/a, error) follows its numbers. Step-level rows get a table of
    their own below the others, one line per phase (`STEP_COLUMNS`)."""
    plain = [r for r in rows if r["level"] != "step"]
    step = [line for r in rows if r["level"] == "step" for line in _phase_lines(r)]
    tables = [_table(plain, COLUMNS) if plain or not step else None, _table(step, STEP_COLUMNS) if step else None]
    return "\n\n".join(t for t in tables if t)


def _phase_lines(row: dict) -> list[dict]:
    """A step-level row as one line per phase (the row's own numbers are the total's). A row that did not run (dry
    run, skipped, failed) still shows each phase's ceiling, its note on the first line."""
    from mmpg.bench.step import PHASE_CEILINGS, PHASES

    keep = {k: row.get(k) for k in ("level", "P", "S", "G", "Q", "variant", "rho_lin", "rho_attn", "rho_flops")}
    sp = (row.get("config") or {}).get("sp", 1)
    if sp > 1:  # the row spread over sp ranks (`mmpg.bench.sp`; its own table has the per-rank figures)
        keep["variant"] = f"{row['variant']} sp{sp}"
    if row.get("variant") == "tree":
        keep.update({k: row.get(f"{k}_tree") for k in ("rho_lin", "rho_flops")})
    names = (*PHASES, "total")
    from mmpg.bench.levels import ceiling_key

    phases = row.get("phases") or {name: {"ceiling": row.get(ceiling_key(row, PHASE_CEILINGS[name] or ""))}
                                   for name in names}
    names = [name for name in names if name in phases]
    return [dict(keep, phase=name, note=row.get("note") if i == 0 or row.get("phases") else "", **phases[name])
            for i, name in enumerate(names)]


def _table(rows: list[dict], columns, na=MEMORY_COLUMNS, gaps: bool = True) -> str:
    """Header, rule and one line per row; with `gaps`, a blank line between configs (and step-level variants)."""
    header = "  ".join(h.rjust(w) if k not in LEFT else h.ljust(w) for k, h, w, _ in columns)
    lines = [header + "  note", "-" * (len(header) + 6)]
    last = None
    for row in rows:
        key = (row["level"], row["P"], row["S"], row["G"], row.get("variant") if "phase" in row else None)
        if gaps and last is not None and key != last:
            lines.append("")
        last = key
        cells = "  ".join(_cell(row, k, w, f, na) for k, _, w, f in columns)
        lines.append(f"{cells}  {row.get('note') or ''}".rstrip())
    return "\n".join(lines)


_COLUMN = {c[0]: c for c in COLUMNS}
ROLLOUT_COLUMNS = [("B", "B", 2, "{}"), *(_COLUMN[k] for k in "PSG"), ("variant", "variant", 13, "{}"),
                   _COLUMN["time_s"], _COLUMN["speedup"], ("prefill_s", "prefill_s", 9, "{:.3f}"),
                   ("decode_s", "decode_s", 8, "{:.3f}"), ("kv_MB", "kv_MB", 7, "{:.1f}"),
                   ("kv_ratio", "kv_ratio", 8, "{:.2f}"), *(_COLUMN[k] for k in ("rho_lin", "peak_MB", "mem_ratio"))]


def rollout_table(rows: list[dict]) -> str:
    """The rollout rows with their phases and K/V (kv_ratio against the copy path; compare with rho_lin); a missing
    number is "-" here, memory too (the main table says n/a)."""
    rows = [r for r in rows if r["level"] == "rollout"]
    if not rows:
        return ""
    lines = ["rollout phases (kv_ratio: the copy path's K/V over this one's; theory for cascade: rho_lin)",
             _table(rows, ROLLOUT_COLUMNS, na=(), gaps=False)]
    if any(r["variant"] == "vllm" for r in rows):
        lines += VLLM_NOTE
    return "\n".join(lines)


EVAL_COLUMNS = [("B", "B", 2, "{}"), *(_COLUMN[k] for k in "PS"), ("Q", "Q", 2, "{}"), ("t", "t", 3, "{}"),
                ("variant", "variant", 11, "{}"), _COLUMN["time_s"], _COLUMN["speedup"],
                ("rho_eval", "ceil", 5, "{:.2f}"), _COLUMN["pct_ceiling"],
                ("prefill_s", "prefill_s", 9, "{:.3f}"), ("decode_s", "decode_s", 8, "{:.3f}"),
                ("prefixes", "prefills", 8, "{}"), ("prefix_tokens", "prefill_tok", 11, "{}"),
                ("same_answers", "same", 4, "{}"), *(_COLUMN[k] for k in ("peak_MB", "mem_ratio"))]


def eval_table(rows: list[dict]) -> str:
    """The eval rows: greedy answers to Q queries of each of B videos; speedup against per-query (mmpg), ceil = the
    layout's FLOPs ceiling (`rho_eval`, the tree's for the tree row), prefills / prefill_tok = the engine's
    `last_stats` (leading parts prefilled, prompt tokens prefilled), same = answers identical to hf_generate's."""
    from mmpg.bench.levels import ceiling_key

    rows = [dict(r, rho_eval=r.get(ceiling_key(r, "rho_eval"))) for r in rows if r["level"] == "eval"]
    if not rows:
        return ""
    return "\n".join(["eval: Q queries of one video, one greedy answer of S tokens each, B videos per batch (speedup "
                      "over mmpg = per query; same = of the B·Q answers, those identical to hf_generate's)",
                      _table(rows, EVAL_COLUMNS, na=(), gaps=False)])


def tree_table(rows: list[dict]) -> str:
    """Per phase, the tree (a video's shared part forwarded once for its Q queries) against per-query grouping
    (mmpg): both times, their ratio, and its ceiling = the tree's FLOPs ceiling over per-query grouping's (each
    over naive, `mmpg.bench.flops.ceilings_q`); tokens = the update's forward tokens of each."""
    from mmpg.bench.step import PHASE_CEILINGS, PHASES

    trees = [r for r in rows if r["variant"] == "tree" and r["level"] == "step"]
    if not trees:
        return ""
    lines = ["tree vs per-query grouping (Q queries of one video, tail t tokens each; ceil: the FLOPs ratio, "
             "tok_ceil: the token ratio of the update's forward)",
             f"{'P':>6}  {'S':>4}  {'G':>3}  {'Q':>2}  {'t':>3}  {'phase':<7}  {'mmpg_s':>8}  {'tree_s':>8}  "
             f"{'tree/mmpg':>9}  {'ceil':>5}  {'%ceil':>5}  {'tok_ceil':>8}  {'tokens':>13}"]
    notes = []
    lines.append("-" * len(lines[1]))
    for tree in trees:
        per = next((r for r in rows if r["variant"] == "mmpg" and r["config"] == dict(tree["config"])), None)
        if per is None:
            continue
        for name in (*PHASES, "total"):
            a, b = (per.get("phases") or {}).get(name, {}), (tree.get("phases") or {}).get(name, {})
            key = PHASE_CEILINGS[name]
            ceil = tree.get(f"{key}_tree") / per[key] if key and per.get(key) else None
            ratio = a["time_s"] / b["time_s"] if a.get("time_s") and b.get("time_s") else None
            pct = 100 * ratio / ceil if ratio and ceil else None
            toks = f"{per.get('tokens')} -> {tree.get('tokens')}" if name == "update" and tree.get("tokens") else ""
            tok_ceil = tree["rho_lin_tree"] / per["rho_lin"] if name == "update" and per.get("rho_lin") else None
            cells = [f"{tree['P']:>6}", f"{tree['S']:>4}", f"{tree['G']:>3}", f"{tree['Q']:>2}", f"{tree['t']:>3}",
                     f"{name:<7}"] + [_fmt(v, f, w) for v, f, w in (
                         (a.get("time_s"), "{:.3f}", 8), (b.get("time_s"), "{:.3f}", 8), (ratio, "{:.2f}", 9),
                         (ceil, "{:.2f}", 5), (pct, "{:.0f}", 5), (tok_ceil, "{:.2f}", 8))] + [f"{toks:>13}"]
            lines.append("  ".join(cells).rstrip())
        notes.append(_tree_note(per, tree))
    return "\n".join(lines + notes)


def _tree_note(per: dict, tree: dict) -> str:
    """The work each layout did (vision-tower encodes, the rollout cache's K/V, prompt tokens prefilled) and the
    true three-level tree's token ceiling beside the repeated-tail tree's."""
    from mmpg.bench.flops import rho_lin_q, rho_lin_true_tree

    P, t, S, G, Q = tree["P"], tree["t"], tree["S"], tree["G"], tree["Q"]
    true = rho_lin_true_tree(P, t, S, G, Q) / rho_lin_q("per_query", P, t, S, G, Q)

    def work(r):
        kv = f"{r['kv_bytes'] / 2**20:.1f} MB" if r.get("kv_bytes") else "-"
        prefill = (r.get("rollout_stats") or {}).get("prefix_tokens", "-")
        return f"vision-tower videos {r.get('vision_calls', '-')}, rollout K/V {kv}, prefill tokens {prefill}"

    return (f"  P {P} Q {Q}: per query: {work(per)}; tree: {work(tree)}; token ceiling of a true three-level tree "
            f"(tails once per query): {true:.2f}")


def _fmt(value, fmt: str, width: int) -> str:
    return (fmt.format(value) if value is not None else "-").rjust(width)


VLLM_NOTE = [
    "vllm: VLLMEngine.generate_groups against mmpg vllm-serve (127.0.0.1): vLLM's own kernels and scheduler (CPU: its",
    "  paged attention, eager) in the server's --dtype (the config's), HTTP, frame packing and the server's",
    "  frames -> patches preprocessing included (the other rows get patches ready-made); the G samples",
    "  of a prompt share its K/V in vLLM's prefix cache, and every step's prompts are new to it (no cached prefill).",
    "  The other rows: transformers + torch in the bench's own process. The server's phases, K/V and memory are not",
    "  seen from here (- and n/a)."]


def describe_config(config: dict) -> str:
    """One line naming what a config measures (printed above the table)."""
    if config["level"] == "attention":
        return (f"attention: {config['heads']} q / {config['kv_heads']} kv heads of {config['head_dim']}, "
                f"{config.get('dtype', 'float32')}")
    spec = config["spec"]
    lm = (f"{config['family']} hidden {spec['hidden_size']}, {spec['num_layers']} layers, "
          f"{spec['num_heads']}/{spec['num_kv_heads']} heads")
    if config["level"] == "eval":
        videos = "one video" if config.get("B", 1) == 1 else f"each of {config['B']} videos in one batch"
        return (f"eval: {lm}, {config.get('dtype', 'float32')}; {config.get('Q', 1)} queries of {videos}, tails of "
                f"{config.get('t', 32)} tokens, one greedy answer of exactly {config['S']} tokens each")
    if config["level"] == "step":
        return (f"step: one GRPO step of {lm}, vision {spec.get('vision_hidden_size', 32)} x "
                f"{spec.get('vision_depth', 2)} (frozen), {config.get('dtype', 'float32')}"
                + (", gradient checkpointing" if config.get("grad_ckpt") else "")
                + (f"; {config['Q']} queries of one video, tails of {config['t']} tokens" if config.get("Q", 1) > 1
                   else "")
                + f"; {config['G']} responses of exactly {config['S']} tokens, KL beta {config.get('beta', 0.04)} "
                "(reference forward), DeepSpeed ZeRO 0 + AdamW")
    text = f"{config['level']}: {lm}, intermediate {spec['intermediate_size']}, {config.get('dtype', 'float32')}"
    text += ", gradient checkpointing" if config.get("grad_ckpt") else ""
    if config["level"] == "rollout" and (config.get("B", 1) > 1 or config.get("video")):
        text += f"; {config.get('B', 1)} prompts per step"
        text += " of {} frames {}x{}".format(*config["video"]) if config.get("video") else ""
    return text


def provenance() -> dict:
    """What a measured table states beside its figures: versions, device, threads, the date and the commit."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "date": datetime.date.today().isoformat(), "commit": source_commit()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return env


def source_commit() -> str:
    """The short commit of the mmpg checkout being measured, "+" when its files differ from it; "unknown" outside a
    git checkout (an installed wheel)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+" if changed else "")


def default_out_path(root: str = "runs/bench") -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(root, f"{stamp}.json")


def write_json(path: str, rows: list[dict], meta: dict) -> str:
    """Atomic write of {"meta", "rows"} (`atomic_write`); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return atomic_write(path, json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")


def atomic_write(path: str, text: str) -> str:
    """Write a tmp file and rename it over `path` (a reader never sees half a file); returns the path."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
