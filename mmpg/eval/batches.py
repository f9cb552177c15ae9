"""The decoding loop of `mmpg eval`: fixed batches of the benchmark, dealt out to the ranks, answered greedily by
the shared-prefix engine; after every round the records of all ranks are gathered and rank 0 appends them.

    batch size 2, samples 0..7:  fixed batches [0, 1] [2, 3] [4, 5] [6, 7]   (the same for any number of ranks)
    done = {0, 1, 2}:            batches to run [3] [4, 5] [6, 7]            (only the missing samples of a batch)
    W = 2 ranks:                 rank 0: [3] [6, 7]     rank 1: [4, 5] []    (an empty batch still joins the
    round 1: gather -> rank 0 appends 3, 4, 5                                 gather: both make 2 gathers)
    round 2: gather -> rank 0 appends 6, 7

Why fixed batches, dealt out whole, rather than samples dealt out one by one: a prompt's answer can depend on the
batch it is decoded in (left padding changes the rounding; in bfloat16 a greedy near-tie can flip), so every
sample is answered in the same batch whatever the number of ranks: sharded predictions equal one process's. Only a
batch that a killed run left half written is answered in a smaller batch (its missing samples).

Videos are decoded in DataLoader workers (settings.num_workers), prompts built there too (`build_prompt_inputs`).
A sample whose video cannot be used becomes a record with `error` set, never an exception.
"""

from __future__ import annotations

import logging
import math
import os
import time

from torch.utils.data import Dataset

from mmpg.data.dataset import GroundingDataset, VideoDataLoader, VideoItem
from mmpg.data.prompts import build_prompt_inputs
from mmpg.eval.metrics import score_sample, scored_truth
from mmpg.runs.evals import PredictionRecord

log = logging.getLogger("mmpg.eval")


class _Indexed(Dataset):
    """(benchmark index, VideoItem) for each index of `indices`."""

    def __init__(self, samples, indices: list[int], spec):
        self.indices = indices
        self.items = GroundingDataset([samples[i] for i in indices], spec, strict=False)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> tuple[int, VideoItem]:
        return self.indices[j], self.items[j]


class _Collate:
    """-> (indices of usable items, usable items, processor inputs or None, [(index, failed item)])."""

    def __init__(self, processor, template):
        self.processor, self.template = processor, template

    def __call__(self, batch: list[tuple[int, VideoItem]]):
        good = [(i, it) for i, it in batch if it.ok]
        failed = [(i, it) for i, it in batch if not it.ok]
        inputs = None
        if good:
            inputs = build_prompt_inputs(self.processor, [it.sample for _, it in good], [it.video for _, it in good],
                                         self.template)
        return [i for i, _ in good], [it for _, it in good], inputs, failed


def record_for(index: int, item, text: str | None, settings) -> PredictionRecord:
    """The record of one sample: an answer scored against the truth, or (text None) a failed video."""
    sample = item.sample
    video = os.path.abspath(sample.video)  # readers (the app) may run from another folder
    duration = sample.duration if sample.duration is not None else math.nan
    if text is None:
        return PredictionRecord(index=index, sample_id=sample.sample_id, video=video, duration=duration,
                                query=sample.query, gt_span=list(scored_truth(sample, settings.scoring)),
                                pred_span=None, text="", iou=0.0, error=item.error)
    scored, truth = score_sample(text, sample, settings.scoring, settings.swap_reversed)
    return PredictionRecord(index=index, sample_id=sample.sample_id, video=video, duration=duration,
                            query=sample.query, gt_span=list(truth),
                            pred_span=list(scored.span) if scored.span else None, text=text, iou=scored.iou)


def _answer(engine, batch, sampling, settings, checker=None) -> list:
    indices, items, inputs, failed = batch
    records = [record_for(i, it, None, settings) for i, it in failed]
    for i, it in failed:
        log.warning("sample %s (index %d) failed: %s", it.sample.sample_id, i, it.error)
    if items:
        rollout = engine.generate_groups(inputs, 1, sampling)  # [B] answers, rows in prompt order
        if checker is not None:
            _self_check(checker, engine.model, inputs, rollout)
        records += [record_for(i, it, text, settings) for i, it, text in zip(indices, items, rollout.texts)]
    return records


def _self_check(checker, model, inputs, rollout) -> None:
    """eval.self_check: the engine's logprobs of these answers vs the repeated forward, when this batch goes past
    the prompt / answer lengths checked so far (`mmpg.grouping.selfcheck`; the first batch always)."""
    from mmpg.errors import UserError
    from mmpg.grouping.selfcheck import SelfCheckError, batch_dims

    if not checker.needed(model, batch_dims(inputs, rollout.completion_mask, rollout.group_sizes)):
        return
    try:
        checker.run(model, inputs, rollout.completion_ids, rollout.completion_mask, rollout.group_sizes,
                    candidate=rollout.logprobs)
    except SelfCheckError as e:
        raise UserError(str(e)) from None


def fixed_batches(pending: list[int], batch_size: int) -> list[list[int]]:
    """The pending indices grouped by the fixed batch they belong to (index // batch_size), in order."""
    out: dict[int, list[int]] = {}
    for i in sorted(pending):
        out.setdefault(i // batch_size, []).append(i)
    return list(out.values())


def decode_pending(model, processor, samples, pending: list[int], spec, template, settings, writer, session,
                   lockstep: bool = False) -> int:
    """Answer `pending` over all ranks; rank 0 appends every record to predictions.jsonl. Returns the number of
    samples answered (all ranks).

    lockstep (a ZeRO-3 model, whose every forward gathers weights from all ranks): every rank decodes `rounds`
    batches, a rank short of one repeating its first batch with the records dropped, and decodes until every rank
    is done (the engine's all_done); the engine self-check is left out there (its forwards would be one rank's
    alone; training's own self-check covers the grouped forward)."""
    from tqdm.auto import tqdm

    from mmpg.rollout import HFEngine, SamplingParams
    from mmpg import dist

    todo = fixed_batches(pending, settings.batch_size)
    mine = todo[session.rank::session.world]
    rounds = math.ceil(len(todo) / session.world)  # the same on every rank
    lockstep = lockstep and session.world > 1
    real = len(mine)
    if lockstep and todo:
        mine = mine + [mine[0] if mine else todo[0]] * (rounds - real)  # fillers: decoded, records dropped
    shard = [i for b in mine for i in b]
    positions, start = [], 0  # each batch as positions into `shard`
    for b in mine:
        positions.append(list(range(start, start + len(b))))
        start += len(b)
    loader = VideoDataLoader(_Indexed(samples, shard, spec), batch_sampler=positions,
                             num_workers=settings.num_workers if shard else 0, collate_fn=_Collate(processor, template))
    from mmpg.grouping.selfcheck import SelfCheck

    coll = "cuda" if str(session.device).startswith("cuda") else "cpu"
    engine = HFEngine(model, processor, all_done=(lambda d: dist.all_true(d, coll)) if lockstep else None)
    checker = SelfCheck(settings.self_check, what="decode engine") \
        if settings.self_check != "off" and not lockstep else None
    sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0, logprobs=checker is not None)
    batches = iter(loader)
    bar = tqdm(total=len(pending), desc="eval", unit="sample", disable=session.rank != 0, dynamic_ncols=True)
    done, start = 0, time.time()
    for r in range(rounds):
        batch = next(batches, None)
        records = _answer(engine, batch, sampling, settings, checker) if batch is not None else []
        if r >= real:
            records = []  # a lockstep filler
        every = sorted((rec for part in dist.gather_objects(records) for rec in part), key=lambda rec: rec.index)
        writer.append(every)  # rank 0 writes; a no-op elsewhere
        done += len(every)
        bar.update(len(every))
        if session.rank == 0:
            log.info("batch %d/%d: %d/%d samples, %.2f samples/s", r + 1, rounds, done, len(pending),
                     done / max(time.time() - start, 1e-9))
    bar.close()
    return done
