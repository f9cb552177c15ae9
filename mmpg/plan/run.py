"""A run's own plan beside what it measured: `mmpg plan --run RUN_DIR [--gpus N]`.

The plan is made from the run's resolved config (RUN_DIR/config.yaml, through `mmpg.runs`) on the run's device;
the measured figure is the largest `perf/peak_memory_mb` of its metrics.jsonl. On a GPU that is
`torch.cuda.max_memory_allocated` (tensors, as the plan counts them); on a CPU it is the process's `ru_maxrss`,
which also holds the Python process, torch and DeepSpeed themselves (a few hundred MB) — so a CPU run measures above
its plan by about that much. The inspector shows the same pair on a run's page (`inspect_plan`: the memory only,
on the device and device count the run recorded in run.json).

An SFT run is planned as the GRPO model's update phase with one response per prompt (its target: sft/target_tokens
per sample, else SFT_TARGET_TOKENS), no rollout and no reference — an estimate not yet checked against measured
SFT peaks."""

from __future__ import annotations

import copy
from pathlib import Path

from mmpg.errors import UserError

SFT_TARGET_TOKENS = 32
MEASURED = {"cpu": "the process's ru_maxrss: the whole process (Python, torch, DeepSpeed: a few hundred MB above "
                   "the plan's tensors)",
            "cuda": "torch.cuda.max_memory_allocated: the tensors, as the plan counts them"}


def run_plan(run_dir: str, gpus: int, memory: float, hw, device: str | None = None) -> dict:
    """{"plan": `mmpg.plan.whole.plan`'s dict, "measured_peak_mb": the run's largest perf/peak_memory_mb or None,
    "steps": steps with the metric}."""
    from mmpg.config import load_config
    from mmpg.plan.whole import plan
    from mmpg.runs.layout import CONFIG_YAML
    from mmpg.runs.reader import RunReader

    path = Path(run_dir) / CONFIG_YAML
    if not path.is_file():
        raise UserError(f"--run {run_dir}: no {CONFIG_YAML} there; give a run directory (RUNS/NAME)")
    cfg = load_config(str(path), [])
    device = device or ("cpu" if cfg.trainer.device == "cpu" else "cuda")
    peak, steps = measured_peak(RunReader(run_dir).metrics())
    return {"plan": plan(cfg, gpus, device, memory, hw), "measured_peak_mb": peak, "steps": steps}


def render_run(out: dict) -> str:
    p, measured = out["plan"], out["measured_peak_mb"]
    planned = p["peak_bytes"] / 2 ** 20
    line = f"planned per-device peak {planned:.1f} MB; measured perf/peak_memory_mb "
    if measured is None:
        return line + "(none logged yet)"
    what = "ru_maxrss, the whole process" if p["device"] == "cpu" else "max_memory_allocated"
    return line + f"{measured:.1f} MB ({what}; largest of {out['steps']} steps): measured / planned {measured / planned:.2f}"


def measured_peak(metrics: list[dict]) -> tuple[float | None, int]:
    """(the largest perf/peak_memory_mb, how many steps logged it) of metrics.jsonl's lines."""
    key = "perf/peak_memory_mb"
    peaks = [float(m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
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


def sft_config(cfg, metrics: list[dict]):
    """The config as the plan sees an SFT step: one response per prompt (the target), no reference."""
    c = copy.deepcopy(cfg)
    tokens = [m["sft/target_tokens"] for m in metrics if isinstance(m.get("sft/target_tokens"), (int, float))]
    c.rollout.n, c.algorithm.beta = 1, 0.0
    c.rollout.max_new_tokens = max(1, round(max(tokens) / cfg.data.batch_size)) if tokens else SFT_TARGET_TOKENS
    return c


def inspect_plan(run_dir: str, info: dict, metrics: list[dict]) -> dict:
    """The memory side of a run's plan for the inspector: {"device", "devices", "note", "kind", "peak_bytes",
    "peak_phase", "parts" (bytes by part at the peak, largest first), "measured_peak_mb", "measured_steps",
    "measured_means"}. UserError (one line) when the config cannot be planned."""
    from mmpg.config import load_config
    from mmpg.plan.memory import predict
    from mmpg.plan.recipe import recipe_from_config
    from mmpg.runs.layout import CONFIG_YAML

    path = Path(run_dir) / CONFIG_YAML
    if not path.is_file():
        raise UserError(f"no {CONFIG_YAML} in the run directory")
    cfg = load_config(str(path), [])
    device, devices, note = run_device(info, cfg)
    sft = info.get("kind") == "sft"
    mem = predict(recipe_from_config(sft_config(cfg, metrics) if sft else cfg, devices, device), rollout=not sft)
    peak, steps = measured_peak(metrics)
    parts = dict(sorted(((k, v) for k, v in mem["parts"].items() if v), key=lambda kv: -kv[1]))
    return {"device": device, "devices": devices, "note": note, "kind": "sft" if sft else "grpo",
            "peak_bytes": mem["peak_bytes"], "peak_phase": mem["peak_phase"], "parts": parts,
            "measured_peak_mb": peak, "measured_steps": steps, "measured_means": MEASURED[device]}
