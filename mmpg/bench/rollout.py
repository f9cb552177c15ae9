"""Rollout-level variants: sampling G responses of S tokens for each of B prompts of P tokens (no gradient).

    hf_generate    `model.generate(num_return_sequences=G)`: the prompt (and its video) is expanded G times and
                   prefilled G times; every decode step reads the G copies of the prompt's K/V
    mmpg:copy      `HFEngine(decode="copy").generate_groups`: the prompt is prefilled once and its cache copied G ways
    mmpg:cascade   `HFEngine(decode="cascade")`: prefilled once, its K/V held once; each decode step reads it once for
                   the G rows and merges with the rows' own K/V by log-sum-exp (`mmpg.rollout.cascade`)
    mmpg           the engine's default decode mode (cascade)
    mmpg:cascade_flash, mmpg:cascade_sdpa, mmpg:cascade_math   cascade with that kernel (`mmpg.rollout.
                   cascade_kernels`; "cascade" takes the engine's auto choice: sdpa on CPU, math elsewhere)
    vllm           `VLLMEngine.generate_groups` against a `mmpg vllm-serve` started for the config (opt-in: a server
                   takes 1-3 min to start on a CPU; `mmpg.bench.rollout_vllm` says how and what is compared)

B (config key, default 1): the prompts of one step, equal in shape, drawn with seeds 1..B (`make_batch`).

All decode exactly S tokens (no stop token). Besides the total time, each step records its phases, kept in the
worker's `info` and aggregated by `run_config` here:

    prefill_s  the prompt forward up to the first token's logits (generate: until its streamer receives token 0)
    decode_s   the rest: sampling and the S - 1 decode forwards
    kv_MB      the K/V the cache holds after the last decode step (copy: B·G·(P + S - 1) tokens, cascade:
               B·(P + G·S) as its own buffers are preallocated), to compare with ρ_lin = G(P+S)/(P+G·S)

CUDA is synchronised around each phase. `mmpg.rollout` is imported lazily: when it is missing or broken the row
says "not available" and the other variants still run; so does a vllm variant that cannot run here (its row says
why: "skipped: no .venv-vllm (bash scripts/env.sh vllm)", a family or head size vLLM cannot serve, a server that
did not start, with its log's path).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

VARIANTS = ("hf_generate", "mmpg", "vllm")
# the variant's backend slot -> (HFEngine decode mode, cascade kernel backend)
DECODE = {None: ("cascade", "auto"), "copy": ("copy", "auto"), "cascade": ("cascade", "auto"),
          "cascade_flash": ("cascade", "flash"), "cascade_sdpa": ("cascade", "sdpa"),
          "cascade_math": ("cascade", "math")}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_bytes(cache) -> int | None:
    if cache is None:
        return None
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


class _FirstToken:
    """A `generate` streamer that notes when the first new token arrives (its first `put` is the prompt)."""

    def __init__(self, device):
        self.device, self.calls, self.at = device, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            _sync(self.device)
            self.at = time.perf_counter()

    def end(self):
        pass


def make_batch(model, case: dict, ids: dict, device) -> tuple[dict, dict]:
    """The case's B prompts (`B`, default 1) as one batch: prompt_inputs with input_ids [B, P] (equal lengths, no
    padding), videos' patches and grids concatenated; prompt b drawn with seed 1 + b (prompt 0 is `make_inputs`'
    own). Returns (prompt_inputs, info of one prompt: its P and video sizes)."""
    from mmpg.bench.model import make_inputs

    parts = [make_inputs(model, case, ids, device, seed=1 + b) for b in range(case.get("B", 1))]
    return {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}, parts[0][3]


def setup(case: dict, device: torch.device):
    """(None, step, info): model and prompts built here; `step()` samples the B·G responses and appends its phases
    {"prefill_s", "decode_s", "kv_bytes"} to info["phases"]."""
    from mmpg.bench.model import build_model

    variant = case["variant"]
    if variant not in VARIANTS:
        raise ValueError(f"unknown rollout variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    if variant == "vllm":
        from mmpg.bench import rollout_vllm

        return rollout_vllm.setup(case, device)
    if variant == "mmpg":
        if case.get("backend") not in DECODE:
            raise ValueError(f"unknown mmpg rollout decode mode {case.get('backend')!r}; choose one of "
                             f"{', '.join(k for k in DECODE if k)}")
        try:
            from mmpg.rollout import HFEngine, SamplingParams
        except Exception as err:  # noqa: BLE001 - any import failure means the engine is not usable here
            raise NotImplementedError(f"mmpg.rollout not available ({type(err).__name__}: {err})") from None
    model, ids = build_model(case, device)
    model.eval()
    prompt, info = make_batch(model, case, ids, device)
    G, S, B = case["G"], case["S"], prompt["input_ids"].shape[0]
    info["phases"] = []

    if variant == "mmpg":
        decode, backend = DECODE[case.get("backend")]
        engine = HFEngine(model, ids["tokenizer"], decode=decode, cascade_backend=backend)
        sampling = SamplingParams(max_new_tokens=S, temperature=1.0, stop_token_ids=(), logprobs=False)
        prefill, marks = engine._prefill, []

        def timed_prefill(*args, **kwargs):
            out = prefill(*args, **kwargs)
            _sync(device)
            marks.append(time.perf_counter())
            return out

        engine._prefill = timed_prefill  # the bench's own hook on this instance: the engine itself never syncs

        def step():
            _sync(device)
            t0 = time.perf_counter()
            engine.generate_groups(prompt, G, sampling)
            _sync(device)
            t1 = time.perf_counter()
            info["phases"].append({"prefill_s": marks[-1] - t0, "decode_s": t1 - marks[-1],
                                   "kv_bytes": engine.last_kv_bytes})
    else:
        def step():
            streamer = _FirstToken(device)
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(**prompt, num_return_sequences=G, do_sample=True, max_new_tokens=S,
                                     min_new_tokens=S, pad_token_id=0, streamer=streamer,
                                     return_dict_in_generate=True)
            _sync(device)
            t1 = time.perf_counter()
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            info["phases"].append({"prefill_s": streamer.at - t0, "decode_s": t1 - streamer.at,
                                   "kv_bytes": _cache_bytes(cache)})

    info["tokens"] = B * (info["P"] + G * S if variant == "mmpg" else G * (info["P"] + S))
    return None, step, info


# ---- running and reporting (the rollout level's own loop: the generic runner keeps only the step time) --------------
def run_config(config: dict, *, rounds: int, warmup: int, repeats: int, timeout: float, max_gb: float,
               in_process: bool = False, log=print) -> list[dict]:
    """`mmpg.bench.runner.run_config` for a rollout config, its rows extended with the median phases and K/V. A
    vllm variant gets its server here, once for every round (`mmpg.bench.rollout_vllm.serving`), or a skip note."""
    from mmpg.bench import rollout_vllm, runner

    shape = runner.shape_of(config)
    base = {"level": "rollout", "B": config.get("B", 1), "P": shape["P"], "S": config["S"], "G": config["G"],
            **runner.ceilings(config, shape), "est_naive_GB": round(runner.naive_bytes(config, shape) / 1e9, 2),
            "config": config}
    variants = config["variants"]
    if base["est_naive_GB"] > max_gb:
        return [dict(base, variant=v, note=f"skipped: naive needs ~{base['est_naive_GB']:.0f} GB > {max_gb:g} GB")
                for v in variants]
    results, skipped, served = {v: [] for v in variants}, {}, None
    with contextlib.ExitStack() as stack:  # the vLLM server (if any) is stopped however this ends
        if "vllm" in variants:
            skipped["vllm"] = rollout_vllm.skip_reason(config)
            if skipped["vllm"] is None:
                try:
                    served = stack.enter_context(rollout_vllm.serving(config, shape["P"], log=log))
                except rollout_vllm.ServerStartError as err:
                    skipped["vllm"] = f"error: {err.line}"
            if skipped["vllm"]:
                log(f"  rollout vllm: {skipped['vllm']}")
        for r in range(rounds):
            for label in variants[r % len(variants):] + variants[: r % len(variants)]:
                if skipped.get(label):
                    continue
                log(f"  rollout B={base['B']} P={shape['P']} S={config['S']} G={config['G']} {label} "
                    f"(round {r + 1}/{rounds})")
                case = runner.case_for(config, label)
                if label == "vllm":
                    case["vllm_url"] = served["url"]
                res = runner._measure(case, warmup, repeats, timeout, in_process)
                results[label].append(res)
                if res.get("error"):
                    log(f"    -> {res['error']}")
        if served is not None and any(r.get("error") for r in results.get("vllm", [])):
            served["keep_log"] = True
    rows = [dict(base, variant=v, note=skipped[v]) if skipped.get(v) else
            dict(base, variant=v, **runner._aggregate(results[v])) for v in variants]
    for row, v in zip(rows, variants):
        if not skipped.get(v):
            row.update(_phase_medians(results[v], repeats))
        if v == "vllm":
            _vllm_row(row, served)
    return _kv_ratios(rows)


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
    out = {}
    for key in ("prefill_s", "decode_s"):
        values = [p[key] for p in timed if p.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    kv = [p["kv_bytes"] for p in timed if p.get("kv_bytes") is not None]
    out["kv_MB"] = statistics.median(kv) / 2**20 if kv else None
    return out


def _kv_ratios(rows: list[dict]) -> list[dict]:
    """kv_ratio: the copy path's K/V over this row's (the cascade row's is to be compared with ρ_lin)."""
    copy = next((r for r in rows if r["variant"] in ("mmpg:copy", "mmpg") and r.get("kv_MB")), None)
    for row in rows:
        row["kv_ratio"] = copy["kv_MB"] / row["kv_MB"] if copy and row.get("kv_MB") else None
    return rows


PHASE_COLUMNS = [  # (key, header, width, format)
    ("B", "B", 2, "{}"), ("P", "P", 6, "{}"), ("S", "S", 4, "{}"), ("G", "G", 3, "{}"), ("variant", "variant", 13, "{}"),
    ("time_s", "time_s", 8, "{:.3f}"), ("speedup", "speedup", 7, "{:.2f}"), ("prefill_s", "prefill_s", 9, "{:.3f}"),
    ("decode_s", "decode_s", 8, "{:.3f}"), ("kv_MB", "kv_MB", 7, "{:.1f}"), ("kv_ratio", "kv_ratio", 8, "{:.2f}"),
    ("rho_lin", "rho_lin", 7, "{:.2f}"), ("peak_MB", "peak_MB", 8, "{:.0f}"), ("mem_ratio", "mem_ratio", 9, "{:.2f}"),
]


def format_table(rows: list[dict]) -> str:
    """The rollout rows with their phases and K/V (kv_ratio against the copy path; compare with rho_lin)."""
    rows = [r for r in rows if r["level"] == "rollout"]
    if not rows:
        return ""
    header = "  ".join(h.ljust(w) if k == "variant" else h.rjust(w) for k, h, w, _ in PHASE_COLUMNS)
    lines = ["rollout phases (kv_ratio: the copy path's K/V over this one's; theory for cascade: rho_lin)",
             header + "  note", "-" * (len(header) + 6)]
    for row in rows:
        cells = []
        for key, _, width, fmt in PHASE_COLUMNS:
            value = row.get(key)
            text = "-" if value is None else fmt.format(value)
            cells.append(text.ljust(width) if key == "variant" else text.rjust(width))
        lines.append(f"{'  '.join(cells)}  {row.get('note') or ''}".rstrip())
    if any(r["variant"] == "vllm" for r in rows):
        lines += VLLM_NOTE
    return "\n".join(lines)


VLLM_NOTE = [
    "vllm: VLLMEngine.generate_groups against mmpg vllm-serve (127.0.0.1): vLLM's own kernels and scheduler (CPU: its",
    "  paged attention, eager) in the server's --dtype (the config's), HTTP, frame packing and the server's",
    "  frames -> patches preprocessing included (the other rows get patches ready-made); the G samples",
    "  of a prompt share its K/V in vLLM's prefix cache, and every step's prompts are new to it (no cached prefill).",
    "  The other rows: transformers + torch in the bench's own process. The server's phases, K/V and memory are not",
    "  seen from here (- and n/a)."]
