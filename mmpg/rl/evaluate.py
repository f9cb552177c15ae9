"""Held-out evaluation during training (`eval.every_n_steps`): greedy answers on `data.val`, sharded over ranks,
scored with the grounding metrics of `mmpg.eval` and logged to `eval.jsonl` by the loop."""

from __future__ import annotations

from mmpg.data.prompts import get_template
from mmpg.eval.decode import predict
from mmpg.eval.metrics import grounding_metrics
from mmpg.train import dist


def _samples(job):
    if job.eval_samples is None:
        from mmpg.data.formats import load_annotations

        cfg = job.cfg
        result = load_annotations(cfg.data.val, cfg.data.videos or None, fmt=cfg.data.format, strict=False)
        n = cfg.eval.max_samples
        job.eval_samples = result.samples[:n] if n > 0 else result.samples
    return job.eval_samples


def evaluate_heldout(job, step: int) -> dict | None:
    cfg, session = job.cfg, job.session
    if not cfg.data.val:
        return None
    from mmpg.train.setup import video_spec

    samples = _samples(job)
    shard = samples[session.rank::session.world]
    # equal shard lengths: every rank then makes the same number of decoding calls (ZeRO-3 lockstep); the padding
    # repeats the first sample and its predictions are dropped
    width = -(-len(samples) // session.world)
    real = len(shard)
    shard = shard + [samples[0]] * (width - real)
    sync = (lambda done: dist.all_true(done, "cuda" if session.device == "cuda" else "cpu")) \
        if session.world > 1 else None
    preds = predict(session.model, session.processor, shard, video_spec(cfg, session.family),
                    get_template(cfg.data.template), cfg.eval.batch_size, cfg.eval.max_new_tokens, all_done=sync)
    every = [p for part in dist.gather_objects(preds[:real]) for p in part]
    usable = [p for p in every if p.error is None]
    metrics = grounding_metrics([p.span for p in usable], [p.truth for p in usable])
    metrics["skipped"] = float(len(every) - len(usable))
    return {f"eval/{k}": v for k, v in metrics.items()}
