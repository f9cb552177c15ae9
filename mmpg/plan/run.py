"""A run's own plan beside what it measured: `mmpg plan --run RUN_DIR [--gpus N]`.

The plan is made from the run's resolved config (RUN_DIR/config.yaml, through `mmpg.runs`) on the run's device;
the measured figure is the largest `perf/peak_memory_mb` of its metrics.jsonl. On a GPU that is
`torch.cuda.max_memory_allocated` (tensors, as the plan counts them); on a CPU it is the process's `ru_maxrss`,
which also holds the Python process, torch and DeepSpeed themselves (a few hundred MB) — so a CPU run measures above
its plan by about that much. The inspector can show the same pair (`run_plan`)."""

from __future__ import annotations

from pathlib import Path

from mmpg.errors import UserError


def run_plan(run_dir: str, gpus: int, memory: float, hw, device: str | None = None) -> dict:
    """{"plan": `mmpg.plan.cli.plan`'s dict, "measured_peak_mb": the run's largest perf/peak_memory_mb or None,
    "steps": steps with the metric}."""
    from mmpg.config import load_config
    from mmpg.plan.cli import plan
    from mmpg.runs.layout import CONFIG_YAML
    from mmpg.runs.reader import RunReader

    path = Path(run_dir) / CONFIG_YAML
    if not path.is_file():
        raise UserError(f"--run {run_dir}: no {CONFIG_YAML} there; give a run directory (RUNS/NAME)")
    cfg = load_config(str(path), [])
    device = device or ("cpu" if cfg.trainer.device == "cpu" else "cuda")
    peaks = [m["perf/peak_memory_mb"] for m in RunReader(run_dir).metrics() if "perf/peak_memory_mb" in m]
    return {"plan": plan(cfg, gpus, device, memory, hw), "measured_peak_mb": max(peaks) if peaks else None,
            "steps": len(peaks)}


def render_run(out: dict) -> str:
    p, measured = out["plan"], out["measured_peak_mb"]
    planned = p["peak_bytes"] / 2 ** 20
    line = f"planned per-device peak {planned:.1f} MB; measured perf/peak_memory_mb "
    if measured is None:
        return line + "(none logged yet)"
    what = "ru_maxrss, the whole process" if p["device"] == "cpu" else "max_memory_allocated"
    return line + f"{measured:.1f} MB ({what}; largest of {out['steps']} steps): measured / planned {measured / planned:.2f}"
