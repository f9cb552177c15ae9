"""The step-loop driver every training job shares: progress bar, one log line and one metrics line per step,
rollout records, evaluation and checkpoints at their intervals, and a final checkpoint.

A job supplies `train_step(step) -> StepOutput` (collective: every rank calls it), `trainer_state() -> dict` (what a
checkpoint must hold besides weights, optimizer and RNG: the data position) and optionally `evaluate(step)`.
Order within a step: metrics line, then rollouts, then (maybe) the checkpoint. A kill at any point loses at most the
steps after the last complete checkpoint; on resume the run writer drops their lines, so no step is repeated.
"""

from __future__ import annotations

import dataclasses
import logging

from tqdm import tqdm

from mmpg.runs import MEDIA_DIR, media_key
from mmpg.runs.layout import MEDIA_META
from mmpg import choices, dist
from mmpg.errors import is_user_error
from mmpg.train.checkpoint import save_checkpoint

log = logging.getLogger("mmpg.train")

_SHOWN = (("reward/mean", "reward"), ("reward/iou", "tIoU"), ("sft/loss", "loss"), ("timing_s/step", "s/step"))


@dataclasses.dataclass
class StepOutput:
    metrics: dict | None  # the metrics line (rank 0; None elsewhere)
    rollouts: list | None = None  # GroupRecords of the whole global batch (rank 0)
    thumbnails: list | None = None  # (video path, frames, times) not yet stored (rank 0)


class _NoTracker:
    """Stands in for wandb when it is off, so the loop has no `if wandb:` branches."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _tracker(session):
    """wandb on rank 0 when `logging.wandb` is on (resumes the same wandb run for a resumed mmpg run)."""
    cfg = session.cfg
    if not cfg.logging.wandb or session.rank != 0:
        return _NoTracker()
    import wandb  # presence checked in open_session, before anything was written

    from mmpg.config import to_dict

    return wandb.init(project=cfg.logging.wandb_project, name=session.run_dir.name, id=session.run_dir.name,
                      resume="allow", dir=str(session.run_dir), config=to_dict(cfg))


def _line(step: int, total: int, metrics: dict) -> str:
    keys = [k for k in ("reward/mean", "reward/iou", "reward/format", "sft/loss", "actor/loss", "actor/kl",
                        "actor/grad_norm", "response/length_mean", "timing_s/step") if k in metrics]
    return f"step {step}/{total} " + " ".join(f"{k}={metrics[k]:.4g}" for k in keys)


def _record_stop(writer, err: BaseException, recorded) -> None:
    """A run stopped by an error: what the fast paths chose (a self-check's stop among them) into run.json, and the
    error's line into train.log — the console gets it once, from the command."""
    if choices.version() != recorded:
        writer.set_fast_paths(choices.current())
    if isinstance(err, Exception) and is_user_error(err):
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "run stopped: %s", (err,), None)
        for handler in logging.getLogger("mmpg").handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)


def run_loop(job, session) -> None:
    cfg, writer = session.cfg, session.writer
    total, start = cfg.trainer.total_steps, session.start_step
    every_ckpt, every_eval = cfg.checkpoint.every_n_steps, cfg.eval.every_n_steps
    tracker = _tracker(session)
    if start >= total and session.rank == 0:
        log.info("the run is at step %d of trainer.total_steps=%d: nothing to train (raise trainer.total_steps to "
                 "go on, or choose another trainer.run_name for a new run)", start, total)
    bar = tqdm(total=total, initial=start, desc=f"{job.kind}", unit="step", disable=session.rank != 0,
               dynamic_ncols=True)
    recorded = None  # the choices' version last written to run.json
    failed = False
    try:
        for step in range(start + 1, total + 1):
            out = job.train_step(step)
            if session.rank == 0:
                if choices.version() != recorded:  # a fast path chose (or stepped down) during the step
                    recorded = choices.version()
                    writer.set_fast_paths(choices.current())
                    log.info("fast paths: %s", choices.summary())
                media = {}
                for video, frames, times in out.thumbnails or []:
                    media[video] = writer.write_thumbnails(video, frames, times)
                writer.log_metrics(step, out.metrics)
                tracker.log(out.metrics, step=step)
                every_rollouts = cfg.logging.rollouts_every
                if out.rollouts and every_rollouts > 0 and step % every_rollouts == 0:
                    for record in out.rollouts:  # thumbnails of a video are written once, at its first step
                        key = media.get(record.video) or media_key(record.video)
                        if (session.run_dir / MEDIA_DIR / key / MEDIA_META).is_file():
                            record.media_key = key
                    writer.write_rollouts(step, out.rollouts)
                log.info(_line(step, total, out.metrics))
                bar.set_postfix({short: f"{out.metrics[k]:.3g}" for k, short in _SHOWN if k in out.metrics})
                bar.update(1)
            if every_eval > 0 and step % every_eval == 0 and hasattr(job, "evaluate"):
                metrics = job.evaluate(step)
                if session.rank == 0 and metrics:
                    writer.log_eval(step, metrics)
                    tracker.log(metrics, step=step)
                    log.info("eval at step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            if step == total or (every_ckpt > 0 and step % every_ckpt == 0):
                path = save_checkpoint(session.run_dir, step, session.engine, session.processor,
                                       job.trainer_state(), cfg.checkpoint.keep_last, cfg.checkpoint.optimizer_state)
                if session.rank == 0:
                    log.info("checkpoint %s", path)
    except BaseException as err:
        failed = True
        if session.rank == 0:
            _record_stop(writer, err, recorded)
        raise
    finally:
        close = getattr(job, "close", None)
        if close is not None:  # e.g. a GRPO job's rollout thread
            close()
        bar.close()
        writer.close()
        tracker.finish()
        if not failed:  # a rank that failed exits at once: the launcher ends the others, which may be mid-collective
            dist.barrier()
