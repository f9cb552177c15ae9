"""Evaluate every complete checkpoint of a training run, then tabulate and plot the metrics over training steps.

    RUN_DIR/checkpoints/step_00000010/ ... step_00000020/        (complete ones: COMPLETE marker)
    -> RUN_DIR/evals/<benchmark>/step_00000010/ ... step_00000020/   one evaluation folder each (mmpg/runs/evals.py)
    -> RUN_DIR/evals/<benchmark>/over_steps.md, over_steps.png

A checkpoint whose folder already has metrics.json is skipped; one with a partial predictions.jsonl is continued.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mmpg.errors import UserError
from mmpg.eval.runner import EvalResult, eval_session, evaluate_checkpoint
from mmpg.eval.settings import EvalSettings
from mmpg.runs.evals import METRICS_JSON, EvalReader, list_run_evals, run_benchmark_dir, run_eval_dir
from mmpg.runs.files import atomic_write_text
from mmpg.runs.reader import RunReader

log = logging.getLogger("mmpg.eval")

OVER_STEPS_MD = "over_steps.md"
OVER_STEPS_PNG = "over_steps.png"


def evaluate_run(run_dir, annotations, videos, settings: EvalSettings, *, protocol: str = "default",
                 benchmark: str | None = None) -> list[tuple[int, EvalResult | None]]:
    """[(step, result or None when skipped as finished)] for every complete checkpoint, by step."""
    from mmpg import dist

    reader = RunReader(run_dir)
    checkpoints = reader.checkpoints()
    if not checkpoints:
        raise UserError(f"{run_dir}: no complete checkpoint to evaluate (checkpoints/step_*/ holding COMPLETE)")
    benchmark = benchmark or Path(annotations).stem
    out = []
    with eval_session(settings.device) as session:
        for step, path in checkpoints:
            folder = run_eval_dir(run_dir, benchmark, step)
            if (folder / METRICS_JSON).is_file():
                if session.rank == 0:
                    log.info("step %d: already evaluated (%s), skipped", step, folder / METRICS_JSON)
                out.append((step, None))
                continue
            out.append((step, evaluate_checkpoint(path, annotations, videos, folder, settings, protocol=protocol,
                                                  benchmark=benchmark, step=step, session=session)))
        if session.rank == 0:
            write_over_steps(run_dir, benchmark, settings.threshold_rule)
        dist.barrier()
    return out


def write_over_steps(run_dir, benchmark: str, first: str = "gt") -> Path:
    """over_steps.md and over_steps.png from every finished evaluation of `benchmark` in the run."""
    from mmpg.eval.plots import over_steps_plot
    from mmpg.eval.markdown import over_steps_report

    root = run_benchmark_dir(run_dir, benchmark)
    rows = []
    for name, step, folder in list_run_evals(run_dir):
        metrics = EvalReader(folder).metrics() if name == root.name else None
        if metrics is not None:
            rows.append((step, metrics))
    atomic_write_text(root / OVER_STEPS_MD, over_steps_report(benchmark, str(run_dir), rows, first))
    over_steps_plot(root / OVER_STEPS_PNG, rows, first, f"{benchmark}: metrics over training steps")
    return root
