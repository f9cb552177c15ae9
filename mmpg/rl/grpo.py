"""One GRPO step: prompts -> shared-prefix rollout -> rewards -> advantages -> grouped logprobs -> loss -> update.

    collect():  pull this rank's share of a global batch (refilled past unusable videos), sample G responses per
                prompt with one prefill each (HFEngine; or a vLLM server, rollout.engine=vllm), score them; with
                dynamic sampling drop groups whose rewards are all equal and pull more prompts until every rank has
                its share (or the round cap is hit)
    update():   micro-batches of whole groups; per token  -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)
                + beta k3(pi, ref); aggregated as algorithm.loss_type says with the normaliser summed over every
                micro-batch and rank, so W ranks x M micro-batches give the gradient of one big batch; num_iterations
                passes (mu), each one optimizer update; with rollout.tis_cap the policy loss of each token is
                weighted by min(pi_old / pi_rollout, C) (truncated importance sampling, `algos.truncated_is_weights`)
    sync:       rollout.engine=vllm: after the update, rank 0 sends the trainable tensors to the server
                (timing_s/weight_sync; under ZeRO-3 every rank gathers them with it), the other ranks wait for it
    overlap:    rollout.max_staleness = k >= 1 (vLLM): collect() runs in a thread for the next k steps while this
                one updates (`mmpg.rl.overlap`); the sync waits until no rollout that must not see it is running

Rank lockstep (needed by ZeRO-3, whose every forward gathers weights): every rank pulls the same number of batches,
decodes until every rank is done, runs the same number of micro-batches (a rank with fewer repeats one with loss
weight 0) and the same number of LM-head chunks. Response sampling is seeded per prompt (trainer.seed, step, sample
id), so a run on W ranks samples what a one-process run of the same global batch samples.
"""

from __future__ import annotations

import logging
import math
import time
import zlib

import torch

from mmpg.data.dataset import strict_error, video_key
from mmpg.errors import UserError
from mmpg.grouping.inputs import pad_token_id
from mmpg.grouping.selfcheck import SelfCheck, SelfCheckError, batch_dims
from mmpg.models.vision_calls import VisionCalls, prefill_tokens
from mmpg.models.lora import reference_model, without_dropout
from mmpg.rl import algos
from mmpg.rl.batch import PromptGroup, collate_groups, micro_batches, split_groups
from mmpg.train.data import packed_shares
from mmpg.rl.split import generate_split
from mmpg.rl.too_long import drop_too_long
from mmpg.rollout import HFEngine, SamplingParams
from mmpg import choices, dist
from mmpg.train.engine import stage0_grad_norm

log = logging.getLogger("mmpg.train")

MAX_EMPTY_ROUNDS = 50  # rounds in a row in which some rank had no usable sample at all -> the data is unusable
HEAD_CHUNK = 2048  # LM-head rows per chunk (before equalising the chunk count across ranks)


def keep_train_logprobs(mb, logp: torch.Tensor) -> None:
    """The update's first-pass logprobs [n, S] of a micro-batch's groups, each group's rows as `train_logprobs`."""
    row = 0
    for g in mb.groups:
        g.train_logprobs = logp.detach()[row: row + g.size, :g.completion_ids.shape[1]].float().cpu()
        row += g.size


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


def on_every_rank(fn):
    """fn() here (a step against the vLLM server); a ServerError or UserError on any rank becomes, on every rank, a
    UserError with the first failing rank's message, before any rank enters another collective (`dist.first_error`:
    this is the barrier too). Returns fn's result."""
    from mmpg.serve.wire import ServerError

    out, error = None, None
    try:
        out = fn()
    except (ServerError, UserError) as e:
        error = str(e)
    error = dist.first_error(error)
    if error:
        raise UserError(error)
    return out


class GRPOStep:
    """Holds what a step needs; `run(step)` does one step and returns (metrics on rank 0, groups of this rank)."""

    def __init__(self, cfg, engine, ref_model, processor, batches, scorer, device: str, rebuild=None):
        self.cfg, self.engine, self.ref, self.processor = cfg, engine, ref_model, processor
        self.batches = batches  # iterator of GroundingBatch (this rank's share of each global batch)
        self.rebuild = rebuild  # [GroundingSample] -> GroundingBatch, decoded here (`_rebalance`)
        self.scorer, self.device = scorer, device
        self.world = dist.data_size()  # ranks holding different samples (the world / sequence_parallel_size)
        self.local_batch = cfg.data.batch_size // self.world
        sync = (lambda done: dist.all_true(done, self._coll_device)) if dist.world_size() > 1 else None
        self.policy = engine.module.policy
        self.vllm = cfg.rollout.engine == "vllm"
        self.pad_id = pad_token_id(self.policy)  # the collators pad with what the engines pad completions with
        if self.vllm:
            self.rollout_engine = self._vllm_engine(cfg, processor)
        else:
            self.rollout_engine = HFEngine(self.policy, processor, all_done=sync, decode=cfg.rollout.decode,
                                           cascade_backend=cfg.rollout.cascade_backend,
                                           decode_check=cfg.rollout.decode_check,
                                           share_videos=cfg.algorithm.share_videos,
                                           prefill_chunk=cfg.rollout.prefill_chunk)
        self.batches_pulled = 0  # global batches pulled from the loader
        self.batches_trained = 0  # those of the steps trained (the data position is start + this * batch_size)
        # rollout.max_staleness >= 1: the next steps' groups are sampled while this one trains (`mmpg.rl.overlap`)
        self.max_staleness = cfg.rollout.max_staleness if self.vllm else 0
        self.prefetcher = None
        if self.max_staleness:
            dist.make_side_group()  # collective, here on the main thread of every rank
            self.rollout_engine.resync_on_restart = False  # the policy is mid-update: not the weights to resend
        self.checker = SelfCheck(cfg.algorithm.self_check if cfg.algorithm.grouping else "off")
        self.shared_prompts = 0  # per step: see `_logprobs`
        self.row_tokens = 0  # per step: the longest packed row (or sequence-parallel shard) this rank held
        self.vision = VisionCalls(self.policy, ref_model)  # videos the vision towers encode (perf/vision_calls)
        if not self.vllm:
            self.rollout_engine.check_scope = self.vision.paused  # the decode check's forwards go uncounted

    def _vllm_engine(self, cfg, processor):
        """Connect to the vLLM server (waiting up to rollout.vllm_wait_s) and give it this policy's weights (a resumed
        run's differ from the checkpoint the server loaded)."""
        from mmpg.rollout.lengths import check_server_len, worst_prompt
        from mmpg.rollout.vllm import VLLMEngine

        def connect():  # the server must hold the config's longest prompt and a whole response (exit 2 if not)
            engine = VLLMEngine(self.policy, processor, url=cfg.rollout.vllm_url, timeout_s=cfg.rollout.vllm_timeout_s,
                                wait_s=cfg.rollout.vllm_wait_s, sync_timeout_s=cfg.rollout.vllm_sync_timeout_s)
            check_server_len(int(engine.health["max_model_len"]), worst_prompt(cfg, processor),
                             cfg.rollout.max_new_tokens, engine.url)
            return engine

        # every rank connects before any gathers (ZeRO-3), and samples only once the weights are there
        engine = on_every_rank(connect)
        self.sync_weights(engine)
        return engine

    def sync_weights(self, engine=None) -> dict:
        """rollout.engine=vllm: the trainable tensors to the server (rank 0), the other ranks wait; under ZeRO-3
        every rank takes part in gathering them (`VLLMEngine.sync_weights`). engine: default, the step's."""
        engine = engine or self.rollout_engine
        return on_every_rank(lambda: engine.sync_weights() if engine.partitioned or dist.rank() == 0 else {})

    def _generate(self, batch, sampling, seeds):
        """The batch's rollout. Under sequence parallelism the ranks of a group hold the same batch: each samples
        its share of the prompts and the group gathers them (`mmpg.rl.split`)."""
        if dist.sequence_size() > 1:
            return generate_split(lambda part, part_seeds: self._generate_here(part, sampling, part_seeds),
                                  self.policy, batch, seeds, self.pad_id, dist.sequence_size(),
                                  dist.sequence_rank(), dist.gather_sequence)
        return self._generate_here(batch, sampling, seeds)

    def _generate_here(self, batch, sampling, seeds):
        if not self.vllm:
            return self.rollout_engine.generate_groups(batch.inputs, self.cfg.rollout.n, sampling, prompt_seeds=seeds)
        from mmpg.rollout.vllm import PromptTooLongError
        from mmpg.serve.wire import ServerError

        try:
            return self.rollout_engine.generate_groups(batch.inputs, self.cfg.rollout.n, sampling, prompt_seeds=seeds,
                                                       videos=batch.videos)
        except PromptTooLongError as e:
            raise UserError(f"{batch.samples[e.index].where}: {e}".replace(f"prompt {e.index} has", "the prompt has")
                            ) from None
        except ServerError as e:
            raise UserError(str(e)) from None

    @property
    def _coll_device(self):
        if dist.on_side():  # the rollout thread's collectives (`mmpg.rl.overlap`): gloo, on the CPU
            return "cpu"
        return "cuda" if self.device == "cuda" and dist.active() else "cpu"

    # ---- collect -----------------------------------------------------------------------------------------------
    def _pull(self):
        batch = next(self.batches)
        self.batches_pulled += 1
        if batch.skipped and self.cfg.data.strict:
            raise strict_error(batch.skipped[0])
        return batch

    def _rebalance(self, batch):
        """Some rank's whole share of this global batch was unusable while others' was not: the usable samples of
        all ranks, in stream order (the prompts one process trains), are dealt again, each video's whole where it fits
        (`mmpg.train.data.packed_shares`), each rank
        decoding its new share here (`rebuild`). A rank left without one (fewer usable samples than ranks) decodes a
        copy of the first, rolled out for lockstep only. Returns (this rank's batch, number of copies at its end)."""
        usable = [s for part in dist.gather_data(list(batch.samples)) for s in part]
        # at most ceil(n / W) each, a video's queries on one rank where they fit (`packed_shares`)
        shares = packed_shares([video_key(s) for s in usable], self.world, -(-len(usable) // self.world))
        mine = [usable[i] for i in shares[dist.data_rank()]]
        copies = 0 if mine else 1
        mine = mine or usable[:1]
        if [s.sample_id for s in mine] == [s.sample_id for s in batch.samples]:
            return batch, copies  # already here (also when this rank's one sample is the copy)
        if self.rebuild is None:
            raise RuntimeError("GRPOStep needs `rebuild` to deal a global batch again across ranks")
        rebuilt = self.rebuild(mine)
        if len(rebuilt) == 0 and not copies:  # its videos decoded on their own ranks but not here: a copy stands in
            rebuilt, copies = self.rebuild(usable[:1]), 1
        return rebuilt, copies if len(rebuilt) else 0

    def _fit_server(self, batch, info: dict):
        """The batch without the prompts the vLLM server cannot hold (`mmpg.rl.too_long`): each a logged skip
        counted in info["too_long"], or in strict mode one error naming it."""
        batch, skips = drop_too_long(batch, int(self.rollout_engine.health["max_model_len"]),
                                     self.cfg.rollout.max_new_tokens, self.policy, self.pad_id)
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
        info = {"skipped": 0, "rounds": 0, "dropped_groups": 0, "empty_rounds": 0, "prefix_tokens": 0}
        sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                  top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
        if self.vllm:
            info["too_long"] = 0
        while True:
            batch = self._pull()
            if self.vllm:
                batch = self._fit_server(batch, info)
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
                batch, copies = self._rebalance(batch)
            info["rounds"] += 1
            seeds = [prompt_seed(cfg.trainer.seed, step, s.sample_id, info["rounds"]) for s in batch.samples]
            if gate is not None:  # the step's weights: every round of the step samples with them
                version, gate = gate(), None
            with timer("rollout"):
                rollout = self._generate(batch, sampling, seeds)
            info["prefix_tokens"] += prefill_tokens(self.rollout_engine, batch.inputs)  # perf/prefix_tokens
            new = split_groups(self.policy, batch, rollout, seeds)
            for g in new:
                g.policy_version = version
            with timer("reward"):
                for g in new:
                    g.rewards = [self.scorer(text, g.sample) for text in g.texts]
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

    # ---- advantages --------------------------------------------------------------------------------------------
    def advantages(self, groups: list[PromptGroup]) -> None:
        if not groups:
            return
        sizes = [g.size for g in groups]
        rewards = torch.cat([g.overall for g in groups])
        scale = self.cfg.algorithm.scale_rewards
        adv = algos.group_advantages(rewards, sizes, scale="none" if scale == "batch" else scale)
        if scale == "batch":  # the std of every reward of the global batch, over all ranks (dummies left out)
            real = torch.cat([g.overall for g in groups if not g.dummy] or [rewards.new_zeros(0)])
            n, s, ss = dist.data_sum([real.numel(), float(real.sum()), float((real.double() ** 2).sum())],
                                     self._coll_device)
            std = math.sqrt(max(0.0, (ss - s * s / n) / max(1.0, n - 1)))
            adv = adv / (std + 1e-6)
        for g, a in zip(groups, adv.split(sizes)):
            g.advantages = a.float()

    # ---- update ------------------------------------------------------------------------------------------------
    def _logprobs(self, model, mb, chunk: int) -> torch.Tensor:
        """[n, S] float32 logprobs of the micro-batch's responses under `model` (grouped or repeated forward)."""
        from mmpg.grouping import grouped_logprobs, repeated_logprobs

        args = (model, mb.inputs, mb.completion_ids, mb.completion_mask, mb.group_sizes)
        if self.cfg.algorithm.grouping:
            out = grouped_logprobs(*args, temperature=self.cfg.rollout.temperature, chunk_size=chunk,
                                   share=self.cfg.algorithm.share_videos)
            prompts, parts = getattr(model, "_mmpg_shared", (0, 0))
            self.shared_prompts += prompts - parts  # prompts forwarded behind another's shared part
            self.row_tokens = max(self.row_tokens, getattr(model, "_mmpg_row_tokens", 0))
            return out
        return repeated_logprobs(*args, temperature=self.cfg.rollout.temperature)

    def _chunk_sizes(self, mbs) -> list[int]:
        """Per micro-batch LM-head chunk size giving every rank the same number of chunks."""
        rows = [int(mb.completion_mask.sum()) for mb in mbs]
        counts = dist.all_max([math.ceil(r / HEAD_CHUNK) for r in rows], self._coll_device)
        return [max(1, math.ceil(r / max(1, int(c)))) for r, c in zip(rows, counts)]

    def _micro_batches(self, groups):
        per = max(1, self.cfg.trainer.micro_batch_size // self.cfg.rollout.n)  # whole groups per micro-batch
        mbs = micro_batches(groups, per, self.pad_id)
        target = int(dist.all_max([len(mbs)], self._coll_device)[0])
        while len(mbs) < target:  # lockstep filler: same shapes as a real one, loss weight 0
            mbs.append(micro_batches(groups[:per], per, self.pad_id)[0])
            mbs[-1].dummy = True
        return mbs

    def _loss_mask(self, mb) -> torch.Tensor:
        mask = mb.completion_mask
        if self.cfg.algorithm.mask_truncated:
            mask = algos.truncation_mask(mask, mb.truncated)
        return mask.float() * (0.0 if mb.dummy else 1.0)

    def self_check(self, groups: list[PromptGroup], mbs) -> dict:
        """algorithm.self_check: the grouped forward of one of the step's own micro-batches (the first, or the one
        holding the group that goes past the envelope checked so far: its groups packed in rows as the update packs
        them, a video shared by its queries, sequence parallelism where on) against the repeated forward: logprobs,
        logprobs and layer-input gradients with autograd recording, and the leak probe (`mmpg.grouping.selfcheck`).
        Runs when some rank's batch goes past the envelope; every rank checks then, in lockstep (ZeRO-3), with the
        same LM-head chunk count; the figures are the max over ranks. A stop or a step-down is recorded in
        `mmpg.choices` (run.json's fast_paths) before the error or warning."""
        if self.checker.mode == "off":
            return {}
        dims = [batch_dims(g.inputs, g.completion_mask, [g.size]) for g in groups]
        if dist.all_true(not any(self.checker.needed(self.policy, d) for d in dims), self._coll_device):
            return {}
        real = [mb for mb in mbs if not mb.dummy] or mbs[:1]
        first_new = next((g for g, d in zip(groups, dims) if self.checker.needed(self.policy, d)), None)
        mb = next((m for m in real if any(g is first_new for g in m.groups)), real[0])
        rows = int(mb.completion_mask.sum())
        count = int(dist.all_max([math.ceil(rows / HEAD_CHUNK)], self._coll_device)[0])
        try:
            out = self.checker.run(self.policy, mb.inputs, mb.completion_ids, mb.completion_mask, mb.group_sizes,
                                   temperature=self.cfg.rollout.temperature, chunk_size=max(1, math.ceil(rows / count)),
                                   reduce_max=lambda x: dist.all_max([x], self._coll_device)[0],
                                   share=self.cfg.algorithm.share_videos, gradients=True)
        except SelfCheckError as e:
            choices.record("self_check", "stopped", str(e))
            raise UserError(str(e)) from None
        self._record_backend()
        if self.checker.failure:  # algorithm.self_check=warn: the run goes on, and says so in run.json too
            choices.record("self_check", "warned", self.checker.failure)
        prompts, parts = getattr(self.policy, "_mmpg_shared", (1, 1))  # what the checked grouped forward shared
        out["check/shared_prompts"] = dist.all_max([prompts - parts], self._coll_device)[0]
        out["check/groups"] = len(mb.groups)
        return out

    def _record_backend(self) -> None:
        """The self-check's backend choice into `mmpg.choices`; after a fallback the reference's grouped forward
        (a loaded one, or the policy with adapters off) takes the same backend."""
        if self.checker.choice is None:
            return
        backend, why = self.checker.choice
        now = choices.current().get("grouped_backend")
        if not why and now is not None and now["value"] == backend:
            return  # as set up (`mmpg.train.setup.record_grouped_backend`)
        if why and self.ref is not None:  # a frozen reference model; adapters-off LoRA shares the policy's setting
            from mmpg.grouping import set_grouping_options

            set_grouping_options(self.ref, backend=backend)
        choices.record("grouped_backend", backend, why)

    def update(self, groups: list[PromptGroup], timer: Timer) -> dict:
        cfg, alg, engine = self.cfg, self.cfg.algorithm, self.engine
        # the self-check's repeated forward is not the step's work; both of its forwards run without LoRA dropout
        mbs = self._micro_batches(groups)
        with timer("self_check"), self.vision.paused(), without_dropout(self.policy):
            checks = self.self_check(groups, mbs)
        chunks = self._chunk_sizes(mbs)
        masks = [self._loss_mask(mb) for mb in mbs]
        denom = dist.data_sum([sum(algos.loss_denominator(m, alg.loss_type, cfg.rollout.max_new_tokens)
                                  for m, mb in zip(masks, mbs) if not mb.dummy)], self._coll_device)[0]
        old, ref = [None] * len(mbs), [None] * len(mbs)
        with timer("logprob"), torch.no_grad(), without_dropout(self.policy):
            if alg.num_iterations > 1:
                old = [self._logprobs(self.policy, mb, c) for mb, c in zip(mbs, chunks)]
            if alg.beta > 0:  # a loaded reference, or (LoRA) the policy with its adapters off, on every rank alike
                with reference_model(self.policy, self.ref) as ref_model:
                    ref = [self._logprobs(ref_model, mb, c) for mb, c in zip(mbs, chunks)]
        sums = dict.fromkeys(("loss", "kl", "clipped", "tokens", "real_tokens", "gap", "gap_max", "entropy"), 0.0)
        grad_norms = []
        self.shared_prompts = 0
        with timer("update"):
            for it in range(alg.num_iterations):
                for i, (mb, chunk, mask) in enumerate(zip(mbs, chunks, masks)):
                    engine.set_gradient_accumulation_boundary(i == len(mbs) - 1)
                    logp = engine(self._logprobs, mb, chunk)  # through engine.forward (see TrainModule)
                    old_i = logp.detach() if old[i] is None else old[i]
                    per_tok, clipped = algos.clipped_policy_loss(logp, old_i, mb.advantages.to(logp.device),
                                                                 alg.epsilon_low, alg.epsilon_high)
                    mask = mask.to(logp.device)
                    if cfg.rollout.tis_cap > 0:
                        tis = algos.truncated_is_weights(old_i, mb.rollout_logprobs.to(logp.device),
                                                         cfg.rollout.tis_cap, mask)
                        per_tok = per_tok * tis
                        if it == 0:
                            self._accumulate_tis(sums, tis, mask, cfg.rollout.tis_cap)
                    kl = algos.kl_k3(logp, ref[i]) if ref[i] is not None else None
                    if kl is not None:
                        per_tok = per_tok + alg.beta * kl
                    weights = algos.loss_token_weights(mask, alg.loss_type)
                    loss = (weights * per_tok).sum() / denom if denom > 0 else (per_tok * 0).sum()
                    engine.backward(loss * self.world, scale_wrt_gas=False)
                    own_norm = stage0_grad_norm(engine) if i == len(mbs) - 1 else None
                    engine.step()
                    if it == 0:
                        self._accumulate(sums, loss, logp, mb, mask, clipped, kl)
                        if cfg.logging.rollout_logprobs and not mb.dummy:
                            keep_train_logprobs(mb, logp)
                norm = engine.get_global_grad_norm()
                norm = own_norm if norm is None else norm
                grad_norms.append(float(norm) if norm is not None else float("nan"))
        totals = dist.data_sum([sums[k] for k in sums if k != "gap_max"], self._coll_device)
        out = dict(zip([k for k in sums if k != "gap_max"], totals))
        out["gap_max"] = dist.all_max([sums["gap_max"]], self._coll_device)[0]
        out["grad_norm"] = grad_norms[-1]
        out["lr"] = float(engine.get_lr()[0])
        # prompts that the update's grouped forward packed behind another prompt's shared video (all ranks)
        out["shared_prompts"] = dist.data_sum([self.shared_prompts / alg.num_iterations], self._coll_device)[0]
        out["row_tokens"] = dist.all_max([self.row_tokens], self._coll_device)[0]
        self.row_tokens = 0
        out.update(checks)  # check/* on the steps that ran the self-check
        return out

    @staticmethod
    def _accumulate_tis(sums, tis, mask, cap: float) -> None:
        """TIS weight sums (rollout.tis_cap > 0): mean weight and share of tokens capped, over loss tokens."""
        with torch.no_grad():
            sums["tis_weight"] = sums.get("tis_weight", 0.0) + float((tis * mask).sum())
            sums["tis_capped"] = sums.get("tis_capped", 0.0) + float(((tis >= cap) & mask.bool()).sum())

    @staticmethod
    def _accumulate(sums, loss, logp, mb, mask, clipped, kl) -> None:
        """Token sums for the step's metrics (first pass only: with mu > 1 later passes repeat the same data)."""
        with torch.no_grad():
            tokens = float(mask.sum())
            real = mb.completion_mask.to(logp.device).float() * (0.0 if mb.dummy else 1.0)
            gap = (logp.detach() - mb.rollout_logprobs.to(logp.device)).abs() * real
            sums["loss"] += float(loss)
            sums["tokens"] += tokens
            sums["real_tokens"] += float(real.sum())
            sums["clipped"] += float((clipped.float() * mask).sum())
            sums["kl"] += float((kl * mask).sum()) if kl is not None else 0.0
            sums["gap"] += float(gap.sum())
            sums["gap_max"] = max(sums["gap_max"], float(gap.max()) if gap.numel() else 0.0)
            sums["entropy"] += float((-logp.detach() * real).sum())

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
        with timer("rollout_wait"):
            groups, info = self.prefetcher.take(step)
        for phase, seconds in info.pop("timing").items():
            timer.seconds[phase] = timer.seconds.get(phase, 0.0) + seconds
        self.batches_trained = info.pop("pulled_through")
        return groups, info

    def run(self, step: int) -> tuple[dict, list[PromptGroup], dict]:
        """Returns (update sums, this rank's groups, collect info)."""
        timer = Timer()
        t0 = time.perf_counter()
        self.vision.take()  # count this step's encodes only
        groups, info = self._groups(step, timer)
        self.advantages(groups)
        if dist.data_sum([sum(not g.dummy for g in groups)], self._coll_device)[0] == 0 or \
                not dist.all_true(len(groups) > 0, self._coll_device):
            # dynamic sampling kept no group on any rank (or a rank has not even a dummy): nothing to train
            sums = {"skipped_update": 1.0}
        else:
            sums = self.update(groups, timer)
        if self.vllm:  # the server samples the next step (with overlap: step + k + 1) with this step's weights
            if self.prefetcher is not None:  # the rollouts that must not see this step's weights finish first
                with timer("rollout_wait"):
                    self.prefetcher.quiesce(step)
            with timer("weight_sync"):
                info["weight_sync"] = self.sync_weights()
            if self.prefetcher is not None:
                self.prefetcher.published(step)
        timer.seconds["step"] = time.perf_counter() - t0
        info["timing"] = timer.seconds
        info["vision_calls"] = self.vision.take()  # rollout, reference and update forwards (not the self-check)
        return sums, groups, info
