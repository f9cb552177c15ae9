"""The update phase of a GRPO step (`GRPOStep`, `mmpg.rl.grpo`): advantages, the step's micro-batches (whole groups,
the same count on every rank), the self-check on the first of them, the reference's logprobs, and per micro-batch the
policy's logprobs through the training engine, the loss (`mmpg.rl.algos`), backward and the optimizer step; the
step's loss, KL, clip, entropy and gap sums over every rank.
"""

from __future__ import annotations

import math

import torch

from mmpg import choices, dist
from mmpg.errors import UserError
from mmpg.grouping.selfcheck import SelfCheckError, batch_dims
from mmpg.models.lora import reference_model, without_dropout
from mmpg.rl import algos
from mmpg.rl.collect import Timer
from mmpg.train.batch import PromptGroup, micro_batches
from mmpg.train.engine import stage0_grad_norm

HEAD_CHUNK = 2048  # LM-head rows per chunk (before equalising the chunk count across ranks)


def keep_train_logprobs(mb, logp: torch.Tensor) -> None:
    """The update's first-pass logprobs [n, S] of a micro-batch's groups, each group's rows as `train_logprobs`."""
    row = 0
    for g in mb.groups:
        g.train_logprobs = logp.detach()[row: row + g.size, :g.completion_ids.shape[1]].float().cpu()
        row += g.size


class Update:
    """`GRPOStep`'s update phase (its attributes are `GRPOStep`'s: cfg, engine, policy, ref, checker, ...)."""

    def advantages(self, groups: list[PromptGroup]) -> None:
        if not groups:
            return
        sizes = [g.size for g in groups]
        rewards = torch.cat([g.overall for g in groups])
        scale, batch_std = self.cfg.algorithm.scale_rewards, None
        if scale == "batch":  # the std of every reward of the global batch, over all ranks (dummies left out)
            real = torch.cat([g.overall for g in groups if not g.dummy] or [rewards.new_zeros(0)])
            batch_std = algos.pooled_std(*dist.data_sum([real.numel(), float(real.sum()),
                                                         float((real.double() ** 2).sum())], self._coll_device))
        adv = algos.group_advantages(rewards, sizes, scale=scale, batch_std=batch_std)
        for g, a in zip(groups, adv.split(sizes)):
            g.advantages = a.float()

    def _logprobs(self, model, mb, chunk: int) -> torch.Tensor:
        """[n, S] float32 logprobs of the micro-batch's responses under `model` (grouped or repeated forward)."""
        from mmpg.grouping import grouped_forward, repeated_logprobs

        args = (model, mb.inputs, mb.completion_ids, mb.completion_mask, mb.group_sizes)
        clips = mb.completion_visuals  # multi-turn: the clips inside the responses (a trajectory tree)
        if self.cfg.algorithm.grouping:
            out = grouped_forward(*args, temperature=self.cfg.rollout.temperature, chunk_size=chunk,
                                  share=self.cfg.algorithm.share_videos, completion_visuals=clips)
            self.shared_prompts += out.shared_prompts  # prompts forwarded behind another's shared part
            self.row_tokens = max(self.row_tokens, out.row_tokens)
            return out.logprobs
        return repeated_logprobs(*args, temperature=self.cfg.rollout.temperature, completion_visuals=clips)

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
        mask = mb.own_mask  # the model's own tokens (multi-turn: without the tool's turns)
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
                                   share=self.cfg.algorithm.share_videos, gradients=True,
                                   completion_visuals=mb.completion_visuals)
        except SelfCheckError as e:
            choices.record("self_check", "stopped", str(e))
            raise UserError(str(e)) from None
        self._record_backend()
        if self.checker.failure:  # algorithm.self_check=warn: the run goes on, and says so in run.json too
            choices.record("self_check", "warned", self.checker.failure)
        out["check/shared_prompts"] = dist.all_max([out["check/shared_prompts"]], self._coll_device)[0]
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
                    loss = algos.aggregate_loss(per_tok, mask, alg.loss_type, cfg.rollout.max_new_tokens,
                                                denominator=denom)
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
            real = mb.own_mask.to(logp.device).float() * (0.0 if mb.dummy else 1.0)
            gap = (logp.detach() - mb.rollout_logprobs.to(logp.device)).abs() * real
            sums["loss"] += float(loss)
            sums["tokens"] += tokens
            sums["real_tokens"] += float(real.sum())
            sums["clipped"] += float((clipped.float() * mask).sum())
            if kl is not None:  # where: a NaN or inf at a dropped position stays out, as in the loss
                sums["kl"] += float(torch.where(mask.bool(), kl, torch.zeros_like(kl)).sum())
            sums["gap"] += float(gap.sum())
            sums["gap_max"] = max(sums["gap_max"], float(gap.max()) if gap.numel() else 0.0)
            sums["entropy"] += float((-logp.detach() * real).sum())
