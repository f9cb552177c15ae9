"""The decoding loop of `mmpg eval`: fixed batches of the benchmark, dealt out to the ranks, answered greedily by
the shared-prefix engine; after every round the records of all ranks are gathered and rank 0 appends them.

    batch size 2, samples 0..7:  fixed batches [0, 1] [2, 3] [4, 5] [6, 7]   (the same for any number of ranks)
    done = {0, 1, 2}:            batches to run [3] [4, 5] [6, 7]            (only the missing samples of a batch)
    W = 2 ranks:                 rank 0: [3] [6, 7]     rank 1: [4, 5] []    (an empty batch still joins the
    round 1: gather -> rank 0 appends 3, 4, 5                                 gather: both make 2 gathers)
    round 2: gather -> rank 0 appends 6, 7
    lockstep (ZeRO-3): rank 1's empty round 2, or a round whose videos all failed, decodes a blank stand-in

Fixed batches, dealt out whole: a prompt's answer can depend on its batch (left padding changes the rounding; in
bfloat16 a greedy near-tie can flip), so every sample is answered in the same batch whatever the number of ranks and
sharded predictions equal one process's (only a batch a killed run left half written is answered in a smaller one).
With share_videos (the default) a batch holds whole videos, a video's queries side by side (packed greedily up to
batch_size queries, a video with more split over consecutive batches), so they get the very frames and share its
prefill and vision-tower pass; still a pure function of the samples and batch_size:

    batch size 4, videos a: 0 1 5, b: 2 3 4, c: 6:   [0, 1, 5] [2, 3, 4, 6]      (a does not fit beside b)

Videos are decoded and prompts built in DataLoader workers (settings.num_workers). A sample whose video cannot be
used becomes a record with `error` set, never an exception; a video that fails fails each of its queries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time

from torch.utils.data import Dataset

from mmpg.data.dataset import GroundingDataset, VideoDataLoader, VideoItem, stand_in_batch, video_key
from mmpg.data.frame_cache import open_frame_cache
from mmpg.data.prompts import build_prompt_inputs
from mmpg.eval.metrics import score_sample, scored_truth
from mmpg.models.vision_calls import VisionCalls, prefill_tokens
from mmpg.runs.evals import PredictionRecord

log = logging.getLogger("mmpg.eval")


class _Indexed(Dataset):
    """(benchmark index, VideoItem) for each index of `indices`."""

    def __init__(self, samples, indices: list[int], spec, cache=None):
        self.indices = indices
        self.items = GroundingDataset([samples[i] for i in indices], spec, strict=False, cache=cache)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> tuple[int, VideoItem]:
        return self.indices[j], self.items[j]

    def __getitems__(self, js: list[int]) -> list[tuple[int, VideoItem]]:
        """A batch at once: each distinct video decoded once for all its queries (`GroundingDataset`)."""
        return [(self.indices[j], item) for j, item in zip(js, self.items.__getitems__(js))]


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


def record_for(index: int, item, text: str | None, settings, turns: list[dict] | None = None) -> PredictionRecord:
    """The record of one sample: an answer scored against the truth, or (text None) a failed video; `turns`: the
    zoom protocol's trajectory (`PredictionRecord.turns`)."""
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
                            pred_span=list(scored.span) if scored.span else None, text=text, iou=scored.iou,
                            turns=turns)


@dataclasses.dataclass
class ZoomProtocol:
    """template=zoom: the tool's environment, the processor that writes its turns, and the ranks' all_done (None:
    one process, or ranks not in lockstep)."""

    env: object  # mmpg.rollout.zoom.ZoomEnvironment
    processor: object
    all_done: object = None


def _answer(engine, batch, sampling, settings, checker=None, counts: dict | None = None, vision=None,
            stand_in=None, zoom: ZoomProtocol | None = None) -> list:
    """The records of one batch (None: no batch this round); `counts` (when given) gains the batch's prefilled
    tokens and its videos' keys; `vision` (a `VisionCalls`) is paused over the self-check, whose repeated forward is
    not the decoding's work. `stand_in` (lockstep): a callable giving the inputs decoded, answer dropped, when
    nothing of this batch can be decoded, so this rank still joins every forward of the others. `zoom`: each answer
    is a multi-turn trajectory with the zoom tool (`mmpg.rollout.multiturn`), its record holding the turns."""
    from mmpg.rollout.multiturn import sample_trajectories, stand_in_turns
    from mmpg.rollout.zoom import trajectory_turns

    indices, items, inputs, failed = batch if batch is not None else ([], [], None, [])
    records = [record_for(i, it, None, settings) for i, it in failed]
    for i, it in failed:
        log.warning("sample %s (index %d) failed: %s", it.sample.sample_id, i, it.error)
    if not items:
        if stand_in is not None:
            filler = stand_in()
            if zoom is not None and zoom.all_done is not None:  # as many turns as the other ranks take
                prefilled = stand_in_turns(engine, filler, sampling, zoom.env.settings.max_turns, zoom.all_done)
            else:
                engine.generate_groups(filler, 1, sampling)
                prefilled = prefill_tokens(engine, filler)
            if counts is not None:
                counts["prefix_tokens"] += prefilled  # its forwards ran
        return records
    if zoom is not None:
        rollout = sample_trajectories(engine, engine.model, zoom.processor, inputs, [it.sample for it in items], 1,
                                      zoom.env, sampling, all_done=zoom.all_done)
    else:
        rollout = engine.generate_groups(inputs, 1, sampling)  # [B] answers, rows in prompt order
    if counts is not None:  # a multi-turn rollout counts every turn's prefill
        counts["prefix_tokens"] += rollout.prefix_tokens if zoom is not None else prefill_tokens(engine, inputs)
        counts["videos"] |= {video_key(it.sample) for it in items}
    if checker is not None:
        with vision.paused() if vision is not None else contextlib.nullcontext():
            _self_check(checker, engine.model, inputs, rollout)
    turns = [trajectory_turns(t, tools) for t, tools in zip(rollout.turns, rollout.tools)] if zoom is not None \
        else [None] * len(items)
    return records + [record_for(i, it, text, settings, turn)
                      for i, it, text, turn in zip(indices, items, rollout.texts, turns)]


def _self_check(checker, model, inputs, rollout) -> None:
    """eval.self_check: the engine's logprobs of these answers vs the repeated forward, when this batch goes past
    the prompt / answer lengths checked so far (`mmpg.grouping.selfcheck`; the first batch always)."""
    from mmpg.errors import UserError
    from mmpg.grouping.selfcheck import SelfCheckError, batch_dims

    if not checker.needed(model, batch_dims(inputs, rollout.completion_mask, rollout.group_sizes)):
        return
    try:  # a trajectory's tool turns are context: compared where the engine sampled (own_mask)
        checker.run(model, inputs, rollout.completion_ids, rollout.completion_mask, rollout.group_sizes,
                    candidate=rollout.logprobs, completion_visuals=getattr(rollout, "completion_visuals", None),
                    own_mask=getattr(rollout, "own_mask", None))
    except SelfCheckError as e:
        raise UserError(str(e)) from None


def fixed_batches(pending: list[int], batch_size: int) -> list[list[int]]:
    """The pending indices grouped by the fixed batch they belong to (index // batch_size), in order."""
    out: dict[int, list[int]] = {}
    for i in sorted(pending):
        out.setdefault(i // batch_size, []).append(i)
    return list(out.values())


def video_batches(keys: list, batch_size: int) -> list[list[int]]:
    """Batches of whole videos for samples whose videos are `keys` [n] (any hashable per sample): each video's
    indices (in order), videos in the order of their first query, packed greedily up to batch_size; a video
    that does not fit beside the open batch starts a new one, one longer than batch_size is cut into pieces."""
    by_video: dict = {}
    for i, key in enumerate(keys):
        by_video.setdefault(key, []).append(i)
    out: list[list[int]] = []
    room = 0  # free places of the open batch (out[-1])
    for indices in by_video.values():
        if len(indices) > room:
            out.append([])
            room = batch_size
        while len(indices) > room:  # only when the video alone is longer than a batch
            out[-1] += indices[:room]
            indices = indices[room:]
            out.append([])
            room = batch_size
        out[-1] += indices
        room -= len(indices)
    return [b for b in out if b]


def pending_batches(samples, pending: list[int], batch_size: int, share_videos: bool) -> list[list[int]]:
    """The pending indices grouped by their fixed batch (`fixed_batches`, or `video_batches` with share_videos),
    in batch order; a batch with nothing pending is left out."""
    if not share_videos:
        return fixed_batches(pending, batch_size)
    todo = set(pending)
    batches = video_batches([video_key(s) for s in samples], batch_size)
    return [b for b in ([i for i in batch if i in todo] for batch in batches) if b]


@dataclasses.dataclass
class DecodeCounts:
    """What the decoding of one call did, over all ranks (the report's decoding line, metrics.json's perf/*)."""

    samples: int = 0  # samples answered or failed
    videos: int = 0  # distinct videos among the answered samples
    vision_calls: int = 0  # videos (and images) the vision tower encoded: each once when shared
    prefix_tokens: int = 0  # prompt tokens prefilled (the engine's figure when it shares a video's prefill)

    def metrics(self) -> dict:
        return {"perf/samples_decoded": self.samples, "perf/videos": self.videos,
                "perf/vision_calls": self.vision_calls, "perf/prefix_tokens": self.prefix_tokens}


def decode_pending(model, processor, samples, pending: list[int], spec, template, settings, writer, session,
                   lockstep: bool = False) -> DecodeCounts:
    """Answer `pending` over all ranks; rank 0 appends every record to predictions.jsonl. Returns what was done
    over all ranks (samples answered, distinct videos, vision-tower encodes, prefilled tokens; lockstep fillers
    count in the last two: their forwards ran).

    lockstep (a ZeRO-3 model, whose every forward gathers weights from all ranks): every rank runs `rounds`
    rounds and decodes in each until every rank is done (the engine's all_done); a round where this rank has
    nothing to decode (no batch left, or every video of its batch failed: those still become failed records)
    decodes a blank-video stand-in instead (`stand_in_batch`, answer dropped), as training's weight-0 dummies do. The
    engine self-check is left out there (its forwards would be one rank's alone; training's own self-check covers
    the grouped forward)."""
    from tqdm.auto import tqdm

    from mmpg.rollout import HFEngine, SamplingParams
    from mmpg import dist

    todo = pending_batches(samples, pending, settings.batch_size, settings.share_videos)
    mine = todo[session.rank::session.world]
    rounds = math.ceil(len(todo) / session.world)  # the same on every rank
    lockstep = lockstep and session.world > 1
    shard = [i for b in mine for i in b]
    positions, start = [], 0  # each batch as positions into `shard`
    for b in mine:
        positions.append(list(range(start, start + len(b))))
        start += len(b)
    cache = open_frame_cache(settings.frame_cache, settings.frame_cache_gb)
    loader = VideoDataLoader(_Indexed(samples, shard, spec, cache), batch_sampler=positions,
                             num_workers=settings.num_workers if shard else 0, collate_fn=_Collate(processor, template))
    from mmpg.grouping.selfcheck import SelfCheck

    coll = "cuda" if str(session.device).startswith("cuda") else "cpu"
    engine = HFEngine(model, processor, all_done=(lambda d: dist.all_true(d, coll)) if lockstep else None,
                      share_videos=settings.share_videos,  # false: every query prefilled on its own (A/B)
                      decode=settings.decode, cascade_backend=settings.cascade_backend,
                      decode_check=settings.decode_check,  # the kernel chosen and checked as training's rollout
                      prefill_chunk=settings.prefill_chunk)
    checker = SelfCheck(settings.self_check, what="decode engine") \
        if settings.self_check != "off" and not lockstep else None
    stand_in = functools.cache(lambda: stand_in_batch(processor, template).inputs) if lockstep else None
    sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0, logprobs=checker is not None)
    zoom = None
    if template.tools:  # the zoom protocol: multi-turn answers
        from mmpg.rollout.zoom import ZoomEnvironment, ZoomSettings

        env = ZoomEnvironment(ZoomSettings(settings.zoom_fps, settings.zoom_max_frames, settings.zoom_max_turns),
                              spec, decode=cache.frames if cache is not None else None)
        zoom = ZoomProtocol(env, processor, (lambda d: dist.all_true(d, coll)) if lockstep else None)
    batches = iter(loader)
    bar = tqdm(total=len(pending), desc="eval", unit="sample", disable=session.rank != 0, dynamic_ncols=True)
    done, start = 0, time.time()
    counts = {"prefix_tokens": 0, "videos": set()}
    with VisionCalls(model) as vision:
        engine.check_scope = vision.paused  # the decode check's forwards go uncounted
        for r in range(rounds):
            batch = next(batches, None)
            records = _answer(engine, batch, sampling, settings, checker, counts, vision, stand_in, zoom)
            every = sorted((rec for part in dist.gather_objects(records) for rec in part), key=lambda rec: rec.index)
            writer.append(every)  # rank 0 writes; a no-op elsewhere
            done += len(every)
            bar.update(len(every))
            if session.rank == 0:
                log.info("batch %d/%d: %d/%d samples, %.2f samples/s", r + 1, rounds, done, len(pending),
                         done / max(time.time() - start, 1e-9))
    bar.close()
    return _total_counts(done, counts, vision.take())


def _total_counts(done: int, counts: dict, vision_calls: int) -> DecodeCounts:
    """This rank's counts summed (videos: united) over all ranks."""
    from mmpg import dist

    parts = dist.gather_objects((counts["videos"], vision_calls, counts["prefix_tokens"]))
    return DecodeCounts(samples=done, videos=len(set().union(*(p[0] for p in parts))),
                        vision_calls=sum(p[1] for p in parts), prefix_tokens=sum(p[2] for p in parts))
