"""One GRPO step: prompts -> shared-prefix rollout -> rewards -> advantages -> grouped logprobs -> loss -> update.

    collect():  (`mmpg.rl.collect`) pull this rank's slice of a global batch (refilled past unusable videos),
                sample G responses per prompt (the HF engine, one prefill each; or a vLLM server), score them; with
                dynamic sampling drop groups whose rewards are all equal and pull more prompts until every rank has
                its slice (or the round cap is hit)
    update():   (`mmpg.rl.update`) advantages; micro-batches of whole groups; the clipped policy loss + beta k3,
                aggregated with the normaliser summed over every micro-batch and rank (`algos.aggregate_loss`), so
                W ranks x M micro-batches give the gradient of one big batch; num_iterations optimizer updates; with
                rollout.tis_cap each token weighted by min(pi_old / pi_rollout, C) (`mmpg.rl.algos`)
    sync:       rollout.engine=vllm: after the update, rank 0 sends the trainable tensors to the server
                (timing_s/weight_sync; under ZeRO-3 every rank gathers them with it), the other ranks wait for it
    overlap:    rollout.max_staleness = k >= 1 (vLLM): collect() runs in a thread for the next k steps while this
                one updates (`mmpg.rl.overlap`); the sync waits until no rollout that must not see it is running
    data:       timing_s/data, the seconds the step waited for the training loader (its batches, a slice dealt
                again): synchronous, every such wait of collect(); overlapped, the part of the step's waits for the
                rollout thread (timing_s/rollout_wait) in which that thread was waiting for the loader (`LoaderWaits`)

Rank lockstep (ZeRO-3 gathers weights in every forward): every rank pulls the same number of batches, decodes until
every rank is done, runs the same number of micro-batches (a rank with fewer repeats one with loss weight 0) and
LM-head chunks. Sampling is seeded per prompt (trainer.seed, step, sample id), so a run on W ranks samples what a
one-process run of the same global batch samples.
"""

from __future__ import annotations

import logging
import time

from mmpg import dist
from mmpg.errors import UserError
from mmpg.grouping.inputs import pad_token_id
from mmpg.grouping.selfcheck import SelfCheck
from mmpg.models.vision_calls import VisionCalls
from mmpg.rl.collect import Collect, LoaderWaits, Timer
from mmpg.rl.update import Update
from mmpg.train.batch import PromptGroup

log = logging.getLogger("mmpg.train")


def on_every_rank(fn, engine=None):
    """fn() here (a call of the rollout engine that may fail on some ranks only: a vLLM server's connection, rank 0's
    weight sync); a UserError, or an error `engine.user_error` words, on any rank becomes, on every rank, a UserError
    with the first failing rank's message, before any rank enters another collective (`dist.first_error`: this is
    the barrier too). Any other error is raised as it is. Returns fn's result."""
    out, error = None, None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below unless it is the user's to fix
        error = str(e) if isinstance(e, UserError) else engine.user_error(e) if engine is not None else None
        if error is None:
            raise
    error = dist.first_error(error)
    if error:
        raise UserError(error)
    return out


class GRPOStep(Collect, Update):
    """Holds what a step needs; `run(step)` does one step and returns (metrics on rank 0, groups of this rank)."""

    def __init__(self, cfg, engine, ref_model, processor, loader, scorer, device: str, zoom=None):
        self.cfg, self.engine, self.ref, self.processor = cfg, engine, ref_model, processor
        self.zoom = zoom  # the zoom tool's environment (data.template=zoom): multi-turn rollouts, else None
        self.loader = loader  # `mmpg.train.data.TrainLoader`: this rank's slice of each global batch; its `decode`
        self.batches = iter(loader)  # builds a slice dealt again (`_rebalance`)
        self.scorer, self.device = scorer, device
        self.world = dist.data_size()  # ranks holding different samples (the world / sequence_parallel_size)
        self.local_batch = cfg.data.batch_size // self.world
        sync = (lambda done: dist.all_true(done, self._coll_device)) if dist.world_size() > 1 else None
        self.all_done = sync  # every rank done (multi-turn rollouts' turns in lockstep), None for one process
        self.policy = engine.module.policy
        self.pad_id = pad_token_id(self.policy)  # the collators pad with what the engines pad completions with
        from mmpg.rollout.build import make_rollout_engine

        # the engine rollout.engine names: every rank connects before any gathers (ZeRO-3), and samples only once
        # the weights are there (a vLLM server: a resumed run's differ from the checkpoint it loaded)
        self.rollout_engine = on_every_rank(lambda: make_rollout_engine(cfg, self.policy, processor, sync))
        # an engine with its own copy of the weights gets them after each update (none for one that samples with
        # the policy: no collective, no weight_sync timing)
        self.sends_weights = not self.rollout_engine.samples_with_policy
        if self.sends_weights:
            self.sync_weights()
        self.loader_waits = LoaderWaits()  # when a thread waited for the loader (timing_s/data)
        self.batches_pulled = 0  # global batches pulled from the loader
        self.batches_trained = 0  # those of the steps trained (the data position is start + this * batch_size)
        # rollout.max_staleness >= 1: the next steps' groups are sampled while this one trains (`mmpg.rl.overlap`)
        self.max_staleness = cfg.rollout.max_staleness
        self.prefetcher = None
        if self.max_staleness:
            self.rollout_engine.overlap_updates()  # an engine that samples with the policy itself refuses
            dist.make_side_group()  # collective, here on the main thread of every rank
        self.checker = SelfCheck(cfg.algorithm.self_check if cfg.algorithm.grouping else "off")
        self.shared_prompts = 0  # per step: see `_logprobs`
        self.row_tokens = 0  # per step: the longest packed row (or sequence-parallel shard) this rank held
        self.vision = VisionCalls(self.policy, ref_model)  # videos the vision towers encode (perf/vision_calls)
        self.rollout_engine.check_scope = self.vision.paused  # the HF engine's decode check goes uncounted

    def sync_weights(self) -> dict:
        """The policy's new weights to the rollout engine, on every rank (`RolloutEngine.sync_weights`: a vLLM
        server gets the trainable tensors from rank 0, under ZeRO-3 gathered by every rank; the HF engine needs
        nothing); a failure on one rank is a UserError on every rank (`on_every_rank`)."""
        engine = self.rollout_engine
        return on_every_rank(engine.sync_weights, engine)

    @property
    def _coll_device(self):
        if dist.on_side():  # the rollout thread's collectives (`mmpg.rl.overlap`): gloo, on the CPU
            return "cpu"
        return "cuda" if self.device == "cuda" and dist.active() else "cpu"

    # ---- one step ----------------------------------------------------------------------------------------------
    def _collect_ahead(self, step: int, gate) -> tuple[list[PromptGroup], dict]:
        """`collect` in the rollout thread (`mmpg.rl.overlap`): its phase times, and the batches pulled so far."""
        timer = Timer()
        groups, info = self.collect(step, timer, gate)
        info["timing"], info["pulled_through"] = timer.seconds, self.batches_pulled
        return groups, info

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop()

    def _groups(self, step: int, timer: Timer) -> tuple[list[PromptGroup], dict]:
        """The step's groups: collected now, or (rollout.max_staleness >= 1) taken from the rollout thread, whose
        sampling and scoring times are reported as rollout and reward and the wait for it as rollout_wait."""
        if not self.max_staleness:
            groups, info = self.collect(step, timer)
            self.batches_trained = self.batches_pulled
            return groups, info
        if self.prefetcher is None:
            from mmpg.rl.overlap import Prefetcher

            self.prefetcher = Prefetcher(self._collect_ahead, self.max_staleness, step - 1,
                                         self.cfg.trainer.total_steps)
        groups, info = self._wait_for_rollouts(timer, lambda: self.prefetcher.take(step))
        for phase, seconds in info.pop("timing").items():
            timer.seconds[phase] = timer.seconds.get(phase, 0.0) + seconds
        self.batches_trained = info.pop("pulled_through")
        return groups, info

    def _wait_for_rollouts(self, timer: Timer, wait):
        """wait() (the rollout thread's take or quiesce) timed as rollout_wait; the part of it in which that thread
        was waiting for the loader is the step's wait for data too (timing_s/data). Returns wait()'s result."""
        t0 = time.perf_counter()
        out = wait()
        t1 = time.perf_counter()  # the same interval for both: the data wait is never more than rollout_wait
        timer.seconds["rollout_wait"] = timer.seconds.get("rollout_wait", 0.0) + t1 - t0
        timer.seconds["data"] = timer.seconds.get("data", 0.0) + self.loader_waits.within(t0, t1)
        return out

    def run(self, step: int) -> tuple[dict, list[PromptGroup], dict]:
        """Returns (update sums, this rank's groups, collect info)."""
        timer = Timer()
        t0 = time.perf_counter()
        self.vision.take()  # count this step's encodes only
        groups, info = self._groups(step, timer)
        if not self.max_staleness:  # the loader was waited for on this thread, within the collect
            timer.seconds["data"] = self.loader_waits.within(t0, time.perf_counter())
        self.advantages(groups)
        if dist.data_sum([sum(not g.dummy for g in groups)], self._coll_device)[0] == 0 or \
                not dist.all_true(len(groups) > 0, self._coll_device):
            # dynamic sampling kept no group on any rank (or a rank has not even a dummy): nothing to train
            sums = {"skipped_update": 1.0}
        else:
            sums = self.update(groups, timer)
        # the engine samples the next step (with overlap: step + k + 1) with this step's weights (a vLLM server
        # gets them now; the HF engine samples with the policy itself: nothing to send)
        if self.prefetcher is not None:  # the rollouts that must not see this step's weights finish first
            self._wait_for_rollouts(timer, lambda: self.prefetcher.quiesce(step))
        if self.sends_weights:
            with timer("weight_sync"):
                info["weight_sync"] = self.sync_weights()
        if self.prefetcher is not None:
            self.prefetcher.published(step)
        self.loader_waits.forget_ended()
        timer.seconds["step"] = time.perf_counter() - t0
        info["timing"] = timer.seconds
        info["vision_calls"] = self.vision.take()  # rollout, reference and update forwards (not the self-check)
        return sums, groups, info
