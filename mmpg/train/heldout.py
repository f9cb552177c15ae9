"""Held-out evaluation during training (`eval.every_n_steps`), on the one decode path `mmpg eval` uses.

    data.val --load_benchmark--> samples (the first eval.max_samples)
      --mmpg.eval.runner.evaluate_loaded(policy in memory, lockstep)--> RUN_DIR/evals/<val stem>/step_N/
         (predictions.jsonl, metrics.json, report.md, plots/: what `mmpg eval --run` writes for a checkpoint,
          so the inspector's Evaluation tab and `mmpg eval --run` see them)
      --> eval/* metrics, which the loop appends to eval.jsonl for the curves

Settings follow the training config: its prompt template (an SFT stage's without the tool's schema where
`sft.list_tools` is false), frames and pixels (data.*), eval.batch_size, eval.share_videos and eval.max_new_tokens,
rollout.prefill_chunk, mmpg's scoring (scoring=mmpg) and failed videos left out of the metrics (bad_videos=skip), as
training's held-out numbers always were. Every rank decodes in lockstep (ZeRO-3 gathers weights in each forward): a
rank with nothing to decode in a round (no batch left, or all its videos failed) decodes a blank-video stand-in
whose answer is dropped (`mmpg.eval.batches.decode_pending`); the failures are counted in eval/skipped.
"""

from __future__ import annotations

from mmpg.eval.runner import Placement, evaluate_loaded, load_benchmark
from mmpg.eval.settings import EvalSettings
from mmpg.runs.evals import run_eval_dir


def heldout_settings(cfg, kind: str = "grpo") -> EvalSettings:
    """The evaluation settings of a `kind` ("grpo" or "sft") run's held-out evaluation: an SFT stage that leaves
    the tool's schema out of its prompt (`sft.list_tools: false`) is evaluated behind that prompt, as `mmpg eval
    zoom_list_tools=false` evaluates its checkpoints."""
    d = cfg.data
    return EvalSettings(**d.video_values(), template=d.template,  # data.fps, ... : the same VideoSettings block
                        dtype=str(cfg.model.dtype), max_new_tokens=cfg.eval.max_new_tokens, bad_videos="skip",
                        decode=cfg.rollout.decode, cascade_backend=cfg.rollout.cascade_backend,
                        decode_check=cfg.rollout.decode_check,
                        max_samples=cfg.eval.max_samples, format=d.format, batch_size=cfg.eval.batch_size,
                        share_videos=cfg.eval.share_videos, num_workers=d.num_workers, device=cfg.trainer.device,
                        frame_cache=d.frame_cache, frame_cache_gb=d.frame_cache_gb,
                        self_check="off", scoring="mmpg", prefill_chunk=cfg.rollout.prefill_chunk,
                        grouping_backend=cfg.model.grouping_backend, zoom_fps=cfg.zoom.fps,
                        zoom_max_frames=cfg.zoom.max_frames, zoom_max_turns=cfg.zoom.max_turns,
                        zoom_list_tools=cfg.lists_tools(kind))


def evaluate_heldout(job, step: int) -> dict | None:
    """eval/* metrics of the policy at `step` on data.val (rank 0; None elsewhere and without data.val)."""
    import dataclasses

    from mmpg.data.prompts import get_template
    from mmpg.train.setup import video_spec

    cfg, session = job.cfg, job.session
    if not cfg.data.val:
        return None
    settings = heldout_settings(cfg, job.kind)
    template = dataclasses.replace(get_template(cfg.data.template), list_tools=settings.zoom_list_tools)
    if job.eval_samples is None:
        job.eval_samples = load_benchmark(cfg.data.val, cfg.data.videos or None, settings)
    bench = job.eval_samples
    out = run_eval_dir(session.run_dir, bench.name, step)
    result = evaluate_loaded(session.model, session.processor, f"{session.run_dir} (step {step}, in training)", bench,
                             out, settings, Placement(session.rank, session.world, session.device),
                             video_spec(cfg, session.family), template,
                             family=session.family, dtype=session.dtype, step=step, lockstep=True)
    if result.metrics is None:
        return None
    keep = ("count", "miou", "unparseable", "failed") + tuple(k for k in result.metrics if k.startswith("r1@")) + \
        tuple(k for k in result.metrics if k.startswith("zoom/") and "@" not in k)  # template=zoom
    metrics = {f"eval/{k}": float(result.metrics[k]) for k in keep if isinstance(result.metrics.get(k), (int, float))}
    metrics["eval/skipped"] = metrics.pop("eval/failed", 0.0)
    return metrics
