"""The collect phase of a GRPO step (`GRPOStep`, `mmpg.rl.grpo`): pull this rank's slice of a global batch (dealt
again across ranks when some rank's slice was unusable), sample G responses per prompt with the rollout engine
(seeded per prompt: `prompt_seed`), score them, and with dynamic sampling drop the groups whose rewards are all equal
and pull more until every rank has its slice.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import zlib

import torch

from mmpg import dist
from mmpg.data.dataset import strict_error, video_key
from mmpg.errors import UserError
from mmpg.grouping.inputs import parts_of
from mmpg.grouping.sequence import with_video_features
from mmpg.models.lora import without_dropout
from mmpg.models.vision_calls import prefill_tokens
from mmpg.rl import algos
from mmpg.rl.split import generate_split
from mmpg.rl.rewards import score_groups
from mmpg.rl.too_long import drop_too_long
from mmpg.rollout import SamplingParams
from mmpg.train.batch import PromptGroup, split_groups
from mmpg.train.data import packed_slices

log = logging.getLogger("mmpg.train")

MAX_EMPTY_ROUNDS = 50  # rounds in a row in which some rank had no usable sample at all -> the data is unusable


def prompt_seed(seed: int, step: int, sample_id: str, round_: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + round_ * 104_729 + zlib.crc32(sample_id.encode())) % (2 ** 62)


class Timer:
    """Adds wall seconds per phase: `with timer("rollout"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t0

        return _Phase()


class LoaderWaits:
    """The spans of time spent waiting for the training loader (its next batch, or a slice decoded again), recorded
    by whichever thread pulls (the main thread, or the rollout thread of `mmpg.rl.overlap`); `within(a, b)` is the
    part of [a, b] covered by them, a span still open counting up to b. The main thread asks it for the intervals in
    which it was itself blocked (the whole collect when synchronous; its waits for the rollout thread when
    overlapped), so timing_s/data is the wait for data the step saw, not data work hidden behind the update."""

    def __init__(self):
        self.spans: list[list] = []  # [start, end or None], perf_counter seconds
        self.lock = threading.Lock()

    def __call__(self):
        waits = self

        class _Span:
            def __enter__(self):
                self.span = [time.perf_counter(), None]
                with waits.lock:
                    waits.spans.append(self.span)

            def __exit__(self, *exc):
                self.span[1] = time.perf_counter()

        return _Span()

    def within(self, a: float, b: float) -> float:
        with self.lock:
            spans = [(s, b if e is None else e) for s, e in self.spans]
        return sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans)

    def forget_ended(self) -> None:
        """Drop the closed spans (after a step: later waits start later); an open one is kept."""
        with self.lock:
            self.spans = [s for s in self.spans if s[1] is None]


def count_decodes(info: dict, batch) -> None:
    """Add a batch's `decode_stats` (videos read from their files, or from the frame cache) to the step's info."""
    stats = batch.decode_stats  # empty when the loader did not count
    info["videos_decoded"] = info.get("videos_decoded", 0) + int(stats.get("decoded", 0))
    info["videos_cached"] = info.get("videos_cached", 0) + int(stats.get("cached", 0))
    info["frames_decoded"] = info.get("frames_decoded", 0) + int(batch.decoded_frames)


class Collect:
    """`GRPOStep`'s collect phase (its attributes are `GRPOStep`'s: cfg, policy, rollout_engine, batches, ...)."""

    def _generate(self, batch, sampling, seeds):
        """The batch's rollout. Under sequence parallelism the ranks of a group hold the same batch: each samples
        its part of the prompts and the group gathers them (`mmpg.rl.split`). A batch whose videos each rank decoded
        only its part of is first encoded by the group, each distinct video once, and sampled from the whole
        videos' features (`mmpg.grouping.sequence.with_video_features`)."""
        if dist.sequence_size() > 1:
            if parts_of(batch.inputs):  # as the engine samples: no autograd, no adapter dropout
                with torch.no_grad(), without_dropout(self.policy):
                    inputs = with_video_features(self.policy, batch.inputs, dist.sequence_group(),
                                                 [video_key(s) for s in batch.samples])
                batch = dataclasses.replace(batch, inputs=inputs)
            return generate_split(lambda part, part_seeds: self._generate_here(part, sampling, part_seeds),
                                  self.policy, batch, seeds, self.pad_id, dist.sequence_size(),
                                  dist.sequence_rank(), dist.gather_sequence)
        return self._generate_here(batch, sampling, seeds)

    def _generate_here(self, batch, sampling, seeds):
        """The engine's rollout of the batch; an error whose cause is the user's to fix (a server gone or refusing,
        a prompt it cannot hold) is a UserError naming the sample (`RolloutEngine.user_error`)."""
        engine = self.rollout_engine
        try:
            if self.zoom is not None:  # multi-turn: G trajectories per prompt, with the zoom tool's turns
                from mmpg.rollout.multiturn import sample_trajectories

                # the ranks' turns in lockstep where the engine runs the policy's forwards (ZeRO-3 gathers weights
                # in each); a server's requests need none
                lockstep = self.all_done if getattr(engine, "samples_with_policy", True) else None
                return sample_trajectories(engine, self.policy, self.processor, batch.inputs, batch.samples,
                                           self.cfg.rollout.n, self.zoom, sampling, prompt_seeds=seeds,
                                           all_done=lockstep, videos=batch.videos)
            return engine.generate_groups(batch.inputs, self.cfg.rollout.n, sampling, prompt_seeds=seeds,
                                          videos=batch.videos)
        except Exception as e:  # noqa: BLE001 - the engine says which errors are the user's; the rest are raised
            message = engine.user_error(e, [s.where for s in batch.samples])
            if message is None:
                raise
            raise UserError(message) from None

    def _pull(self, info: dict):
        with self.loader_waits():
            batch = next(self.batches)
        count_decodes(info, batch)
        self.batches_pulled += 1
        if batch.skipped and self.cfg.data.strict:
            raise strict_error(batch.skipped[0])
        return batch

    def _decode(self, samples, info: dict):
        """A slice dealt again, decoded here: a wait for data like a pull (`LoaderWaits`), its videos counted."""
        with self.loader_waits():
            batch = self.loader.decode(samples)
        count_decodes(info, batch)
        return batch

    def _rebalance(self, batch, info: dict):
        """Some rank's whole slice of this global batch was unusable while others' was not: the usable samples of
        all ranks, in stream order (the prompts one process trains), are dealt again, each video's whole where it fits
        (`mmpg.train.data.packed_slices`), each rank decoding its new slice here (`TrainLoader.decode`). A rank left
        without one (fewer usable samples than ranks) decodes a copy of the first, rolled out for lockstep only.
        Returns (this rank's batch, number of copies at its end)."""
        usable = [s for part in dist.gather_data(list(batch.samples)) for s in part]
        # at most ceil(n / W) each, a video's queries on one rank where they fit (`packed_slices`)
        slices = packed_slices([video_key(s) for s in usable], self.world, -(-len(usable) // self.world))
        mine = [usable[i] for i in slices[dist.data_rank()]]
        copies = 0 if mine else 1
        mine = mine or usable[:1]
        if [s.sample_id for s in mine] == [s.sample_id for s in batch.samples]:
            return batch, copies  # already here (also when this rank's one sample is the copy)
        rebuilt = self._decode(mine, info)
        if len(rebuilt) == 0 and not copies:  # its videos decoded on their own ranks but not here: a copy stands in
            rebuilt, copies = self._decode(usable[:1], info), 1
        return rebuilt, copies if len(rebuilt) else 0

    def _fit_server(self, batch, info: dict):
        """The batch without the prompts the engine cannot hold (`RolloutEngine.max_model_len`, a vLLM server's;
        the HF engine has no limit of its own: the batch as it is), `mmpg.rl.too_long`: each a logged skip counted
        in info["too_long"], or in strict mode one error naming it."""
        limit = self.rollout_engine.max_model_len
        if limit is None:
            return batch
        info.setdefault("too_long", 0)  # data/too_long: reported for an engine with a limit, 0 included
        batch, skips = drop_too_long(batch, int(limit), self.cfg.rollout.max_new_tokens, self.policy, self.pad_id)
        if skips and self.cfg.data.strict:
            raise strict_error(skips[0])
        for skip in skips:
            log.warning("skipped %s: %s", skip.where, skip.reason)
        info["too_long"] += len(skips)
        return batch

    def collect(self, step: int, timer: Timer, gate=None) -> tuple[list[PromptGroup], dict]:
        """This rank's groups of the step, sampled with the weights after step step - 1 (the synchronous loop), or
        with those `gate()` returns once they are on the server (the rollout thread, `mmpg.rl.overlap`: called
        before the step's first request, so the batch is pulled and decoded while the weights are still on their
        way). A rank that ends with none of its own while others have some gets one dummy group (weight 0) so that
        the ranks stay in lockstep and train what one process trains."""
        version = step - 1
        cfg, groups, spare = self.cfg, [], None
        info = {"skipped": 0, "rounds": 0, "dropped_groups": 0, "empty_rounds": 0, "prefix_tokens": 0,
                "videos_decoded": 0, "videos_cached": 0, "frames_decoded": 0}
        sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                  top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
        while True:
            batch = self._fit_server(self._pull(info), info)
            info["skipped"] += len(batch.skipped)
            counts = [int(c) for c in dist.gather_data(len(batch))] if self.world > 1 else [len(batch)]
            if sum(counts) == 0:  # the whole global batch is unusable (so it is for one process too)
                info["empty_rounds"] += 1
                if info["empty_rounds"] >= MAX_EMPTY_ROUNDS:
                    raise UserError(f"{MAX_EMPTY_ROUNDS} global batches in a row had no usable video; check the "
                                    "data with mmpg check-data")
                continue
            copies = 0
            if min(counts) == 0:
                batch, copies = self._rebalance(batch, info)
            info["rounds"] += 1
            seeds = [prompt_seed(cfg.trainer.seed, step, s.sample_id, info["rounds"]) for s in batch.samples]
            if gate is not None:  # the step's weights: every round of the step samples with them
                version, gate = gate(), None
            with timer("rollout"):
                rollout = self._generate(batch, sampling, seeds)
            # perf/prefix_tokens; a multi-turn rollout counts every turn's prefill
            info["prefix_tokens"] += rollout.prefix_tokens if self.zoom is not None else \
                prefill_tokens(self.rollout_engine, batch.inputs)
            new = split_groups(self.policy, batch, rollout, seeds)
            for g in new:
                g.policy_version = version
            with timer("reward"):
                score_groups(self.scorer, new, self.cfg.zoom if self.zoom is not None else None)
            for g in new[len(new) - copies:]:
                g.dummy = True
            new, spare = new[:len(new) - copies], spare or (new[-1] if copies else None)
            if cfg.algorithm.dynamic_sampling and new:
                flat = torch.cat([g.overall for g in new])
                equal = algos.zero_variance_groups(flat, [g.size for g in new]).tolist()
                info["dropped_groups"] += sum(equal)
                spare = spare or next((g for g, e in zip(new, equal) if e), None)
                new = [g for g, e in zip(new, equal) if not e]
            groups += new
            enough = len(groups) >= self.local_batch
            if not cfg.algorithm.dynamic_sampling or info["rounds"] >= cfg.algorithm.max_sampling_rounds or \
                    dist.all_true(enough, self._coll_device):
                break
        groups = groups[:self.local_batch]
        if not groups and spare is not None:
            spare.dummy = True
            groups = [spare]
        return groups, info
