"""A run's own plan beside what it measured: `mmpg plan --run RUN_DIR [--gpus N]`, and the inspector's memory card
(`inspect_plan`: the memory only, on the device and device count the run recorded in run.json).

The plan is made from the run's resolved config (RUN_DIR/config.yaml, through `mmpg.runs`) on the run's device, as
its kind (an SFT run: `mmpg.plan.whole.sft_plan`); the measured figure is the largest `perf/peak_memory_mb` of its
metrics.jsonl, and run.json's "peak_memory" says what it is (`mmpg.train.peak_memory`, `measure_of`). On a GPU,
`torch.cuda.max_memory_allocated`: the tensors, as the plan counts them. On a CPU, the process's memory above its
baseline before the model was loaded, code pages left out: the tensors, as the plan's CPU validation measured them
(`mmpg.plan.validate`), so its stated error applies (CPU_STATED_ERROR). A CPU run that did not record its measure
logged the whole process's ru_maxrss (Python, torch and DeepSpeed: about 1 GB before any tensor): that figure is
shown, never divided by the plan.
"""

from __future__ import annotations

from pathlib import Path

from mmpg.errors import UserError

# the band within which a CPU run's measured peak is expected to fall: the worst |error| of the CPU plan on cases
# measured after the model was written (docs/performance.md, "The memory plan against measured runs": 23.5 %);
# the plan as revised since is within 18.5 % of those cases and 14 % of its eight validation runs (docs/plan.md)
CPU_STATED_ERROR = 0.235
VALIDATION_MMAP_THRESHOLD = 64 << 10  # mmpg.train.peak_memory.VALIDATION_MMAP_THRESHOLD
CPU_ABOVE_BASELINE = "cpu.rss_above_baseline"  # run.json "peak_memory" "measure" (mmpg.train.peak_memory)
MEASURED = {"cpu": "the CPU memory above the process's {baseline} before the model was loaded, code pages left out "
                   "and modules imported later too (mmpg.train.peak_memory): the tensors and the run's own objects, "
                   "as the CPU plan counts them",
            "cpu_whole": "the whole process's ru_maxrss (an older mmpg's CPU figure: Python, torch and DeepSpeed, "
                         "about 1 GB before any tensor), not comparable with the plan's tensors",
            "cuda": "torch.cuda.max_memory_allocated: the tensors, as the plan counts them"}


def _record(info: dict) -> dict:
    """run.json's "peak_memory" record ({} when absent or not a dict)."""
    return info["peak_memory"] if isinstance(info.get("peak_memory"), dict) else {}


def measure_of(info: dict, device: str) -> tuple[str, bool, int]:
    """(what the run's perf/peak_memory_mb is, whether it compares with the plan, the first step it holds for) from
    run.json's "peak_memory" record; a CPU run without it logged the whole process's ru_maxrss."""
    rec = _record(info)
    since = rec.get("from_step") if isinstance(rec.get("from_step"), int) else 1
    if device == "cuda":
        return MEASURED["cuda"], True, 1
    if rec.get("measure") != CPU_ABOVE_BASELINE:
        return MEASURED["cpu_whole"], False, 1
    base = rec.get("baseline_mb")
    baseline = f"resident set ({base / 1024:.2f} GB)" if isinstance(base, (int, float)) else "resident set"
    text = MEASURED["cpu"].format(baseline=baseline)
    threshold = rec.get("mmap_threshold")
    if isinstance(threshold, int) and threshold > VALIDATION_MMAP_THRESHOLD:
        text += (f"; taken at a {threshold // 1024} KiB allocator threshold, so with the heap's slack, which grows "
                 f"from step to step on a small model: the stated error holds at "
                 f"{VALIDATION_MMAP_THRESHOLD // 1024} KiB (MALLOC_MMAP_THRESHOLD_={VALIDATION_MMAP_THRESHOLD})")
    return text, True, since


def error_band_holds(info: dict, device: str) -> bool:
    """Whether the plan's stated CPU error applies to the run's figure: it was measured at the validation's
    allocator threshold (64 KiB); at a higher one (a run's default, 1 MiB) the figure holds the heap's slack too (on the
    demo's tiny model as much again as the tensors)."""
    threshold = _record(info).get("mmap_threshold")
    return device == "cpu" and isinstance(threshold, int) and threshold <= VALIDATION_MMAP_THRESHOLD


def run_plan(run_dir: str, gpus: int, memory: float, hw, device: str | None = None, job: str | None = None) -> dict:
    """{"plan": `mmpg.plan.whole.plan`'s dict (an SFT run's, or `job`'s: `sft_plan`), "measured_peak_mb":
    the run's largest perf/peak_memory_mb or None, "steps": steps with the metric, "measured_means", "comparable":
    whether the figure compares with the plan, "error_band": whether the plan's CPU error applies to it}."""
    from mmpg.config import load_config
    from mmpg.plan.whole import plan, sft_plan
    from mmpg.runs.layout import CONFIG_YAML
    from mmpg.runs.reader import RunReader

    path = Path(run_dir) / CONFIG_YAML
    if not path.is_file():
        raise UserError(f"--run {run_dir}: no {CONFIG_YAML} there; give a run directory (RUNS/NAME)")
    cfg = load_config(str(path), [])
    device = device or ("cpu" if cfg.trainer.device == "cpu" else "cuda")
    reader = RunReader(run_dir)
    info, metrics = reader.info(), reader.metrics()  # each file read once
    means, comparable, since = measure_of(info, device)
    peak, steps = measured_peak(metrics, since)
    if (job or ("sft" if info.get("kind") == "sft" else "train")) == "sft":
        planned = dict(sft_plan(cfg, gpus, device, memory, hw, metrics=metrics))
    else:
        planned = dict(plan(cfg, gpus, device, memory, hw), job="train")
    return {"plan": planned, "measured_peak_mb": peak, "steps": steps, "measured_means": means,
            "comparable": comparable, "error_band": error_band_holds(info, device)}


def verdict(measured: float, planned: float, device: str, error_band: bool = True) -> str:
    """measured / planned, and on a CPU whether that is within the plan's stated error, where it applies
    (`error_band_holds`)."""
    ratio = measured / planned
    if device != "cpu":
        return f"×{ratio:.2f} of the plan"
    if not error_band:
        return (f"×{ratio:.2f} of the plan (its CPU error, ±{CPU_STATED_ERROR:.1%}, is stated at a "
                f"{VALIDATION_MMAP_THRESHOLD // 1024} KiB allocator threshold only)")
    within = "within" if abs(ratio - 1) <= CPU_STATED_ERROR else "outside"
    return f"×{ratio:.2f} of the plan, {within} its CPU error (±{CPU_STATED_ERROR:.1%})"


def render_run(out: dict) -> str:
    p, measured = out["plan"], out["measured_peak_mb"]
    planned = p["peak_bytes"] / 2 ** 20
    line = f"planned per-device peak {planned:.1f} MB; measured perf/peak_memory_mb "
    if measured is None:
        return line + "(none logged yet)"
    line += f"{measured:.1f} MB (largest of {out['steps']} steps): {out['measured_means']}"
    if not out["comparable"]:
        return line  # the means say why
    return line + f"; {verdict(measured, planned, p['device'], out['error_band'])}"


def measured_peak(metrics: list[dict], since: int = 1) -> tuple[float | None, int]:
    """(the largest perf/peak_memory_mb, how many steps logged it) of metrics.jsonl's lines from step `since` on."""
    key = "perf/peak_memory_mb"
    peaks = [float(m[key]) for m in metrics if isinstance(m.get(key), (int, float))
             and not (isinstance(m.get("step"), int) and m["step"] < since)]
    return (max(peaks) if peaks else None), len(peaks)


def run_device(info: dict, cfg) -> tuple[str, int, str]:
    """(device, devices, note) a run ran on: run.json's "device" / "devices", else trainer.device on 1 device (a
    run that did not record them; "auto" is taken as a GPU, and the note says so)."""
    device, devices, note = info.get("device"), info.get("devices"), []
    if device not in ("cpu", "cuda"):
        device = "cpu" if cfg.trainer.device == "cpu" else "cuda"
        if cfg.trainer.device != device:
            note.append(f"the run did not record its device (trainer.device={cfg.trainer.device}): planned for a GPU")
    if not isinstance(devices, int) or devices < 1:
        devices = 1
        note.append("the run did not record its device count: planned for 1")
    return device, devices, "; ".join(note)


def inspect_plan(run_dir: str, info: dict, metrics: list[dict]) -> dict:
    """The memory side of a run's plan for the inspector: {"device", "devices", "note", "kind", "peak_bytes",
    "peak_phase", "parts" (bytes by part at the peak, largest first), "measured_peak_mb", "measured_steps",
    "measured_means", "comparable", "measured_since" (`measure_of`), "error_band" (`error_band_holds`)}. UserError
    (one line) when the config cannot be planned."""
    from mmpg.config import load_config
    from mmpg.plan.memory import predict
    from mmpg.plan.recipe import recipe_from_config
    from mmpg.plan.whole import sft_config
    from mmpg.runs.layout import CONFIG_YAML

    path = Path(run_dir) / CONFIG_YAML
    if not path.is_file():
        raise UserError(f"no {CONFIG_YAML} in the run directory")
    cfg = load_config(str(path), [])
    device, devices, note = run_device(info, cfg)
    sft = info.get("kind") == "sft"
    mem = predict(recipe_from_config(sft_config(cfg, metrics) if sft else cfg, devices, device), rollout=not sft)
    means, comparable, since = measure_of(info, device)
    peak, steps = measured_peak(metrics, since)
    parts = dict(sorted(((k, v) for k, v in mem["parts"].items() if v), key=lambda kv: -kv[1]))
    return {"device": device, "devices": devices, "note": note, "kind": "sft" if sft else "grpo",
            "peak_bytes": mem["peak_bytes"], "peak_phase": mem["peak_phase"], "parts": parts,
            "measured_peak_mb": peak, "measured_steps": steps, "measured_means": means,
            "comparable": comparable, "measured_since": since, "error_band": error_band_holds(info, device)}
