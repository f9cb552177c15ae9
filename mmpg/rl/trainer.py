"""`mmpg train`: GRPO for video temporal grounding on a DeepSpeed engine (ZeRO 0-3, one process or many).

    mmpg train --config configs/cpu_demo.yaml rollout.n=4 optim.lr=1e-5
    torchrun --nproc_per_node 2 -m mmpg.cli train --config ...          (or: deepspeed --num_gpus 8 ...)

Set-up (`mmpg.train.setup`), the step loop (`mmpg.train.loop`) and checkpoints (`mmpg.train.checkpoint`) are shared
with other jobs; what is GRPO's lives in `mmpg.rl.grpo` (the step) and `mmpg.rl.algos` (the maths).
"""

from __future__ import annotations

import logging
import os

from mmpg.config import Config
from mmpg.errors import UserError
from mmpg.models.lora import separate_reference
from mmpg.rl.grpo import GRPOStep
from mmpg.rl.step_log import DriftAlarm, group_records, group_summary, step_metrics, thumbnails
from mmpg.rl.rewards import make_scorer
from mmpg import dist
from mmpg.train.data import make_train_loader
from mmpg.train.loop import StepOutput, run_loop
from mmpg.train.setup import (check_sequence_parallel, frame_cache, grouping_options, load_train_samples, open_session,
                              video_spec, zoom_environment)

log = logging.getLogger("mmpg.train")


def check_grpo_config(cfg: Config) -> None:
    """The combinations that cannot work, refused before anything is loaded or written."""
    g = cfg.rollout.n
    if g < 2:
        raise UserError(f"rollout.n={g}: GRPO needs at least 2 responses per prompt (with one, every advantage is "
                        "0 and nothing is learned)")
    if cfg.trainer.micro_batch_size % g:
        raise UserError(f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} responses would split a group of "
                        f"rollout.n={g}; use a multiple of {g} (a group stays whole in one micro-batch)")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's; the process group is not up yet
    data_ranks = check_sequence_parallel(cfg, world)
    if cfg.data.batch_size % data_ranks:
        raise UserError(f"data.batch_size={cfg.data.batch_size} prompts cannot be split evenly over {data_ranks} "
                        f"{'ranks' if data_ranks == world else 'sequence-parallel groups'}")
    if cfg.parallel.sequence_parallel_size > 1 and cfg.rollout.engine == "vllm":
        raise UserError("parallel.sequence_parallel_size > 1 with rollout.engine=vllm is not supported yet (the "
                        "ranks of a group would each ask the server for their share; untested): use rollout.engine=hf")
    if cfg.rollout.engine == "vllm":
        check_vllm_config(cfg)
    check_staleness(cfg)
    if cfg.data.template == "zoom":
        check_zoom_config(cfg)


def check_zoom_config(cfg: Config) -> None:
    """data.template=zoom (multi-turn rollouts with the zoom tool): what that path does not support yet."""
    if cfg.parallel.sequence_parallel_size > 1 and cfg.rollout.engine == "hf" and cfg.rollout.decode == "copy":
        raise UserError("data.template=zoom with parallel.sequence_parallel_size > 1 and rollout.decode=copy: a "
                        "later turn would re-send the overview, which the group holds as features; use "
                        "rollout.decode=auto (the K/V kept between turns)")


def check_staleness(cfg: Config) -> None:
    """rollout.max_staleness >= 1: sampled by the vLLM server while the trainer updates, and corrected by TIS."""
    k = cfg.rollout.max_staleness
    if k and cfg.rollout.engine != "vllm":
        raise UserError(f"rollout.max_staleness={k} needs rollout.engine=vllm: the hf engine samples with the "
                        "trainer's own model, so rollouts cannot overlap the update; use rollout.max_staleness=0")
    if k and cfg.rollout.tis_cap <= 0:
        raise UserError(f"rollout.max_staleness={k} needs rollout.tis_cap > 0 (e.g. 2): groups sampled by weights up "
                        "to k steps old are weighted by the capped ratio of the current policy to the sampling one")


def check_vllm_config(cfg: Config) -> None:
    """rollout.engine=vllm: what the vLLM path does not support (yet), refused before anything is loaded."""
    if cfg.rollout.temperature != 1.0:
        raise UserError(f"rollout.engine=vllm with rollout.temperature={cfg.rollout.temperature}: the server returns "
                        "vLLM's raw logprobs (temperature 1), which the loss and the mismatch metrics compare with "
                        "the trainer's; use rollout.temperature=1 or rollout.engine=hf")
    # ZeRO-3 works: the ranks gather the sharded parameters together for each weight sync (VLLMEngine.sync_weights)


def sequence_part(session) -> tuple[int, int] | None:
    """(rank, sp) for a loader that decodes only this rank's frames under sequence parallelism (the group then
    samples from the whole videos' gathered features: `mmpg.rl.collect`), or None: whole videos on every rank (sp 1,
    or a transformers whose forward takes no precomputed features, said once)."""
    if session.sp <= 1:
        return None
    from mmpg.rollout.chunks import supports_encoder_outputs

    if not supports_encoder_outputs(session.model):
        if session.rank == 0:
            log.warning("parallel.sequence_parallel_size=%d: each rank decodes its videos whole; decoding only its "
                        "frames needs a forward that takes precomputed vision features (mm_encoder_outputs, "
                        "transformers >= 5.18) to sample from the group's", session.sp)
        return None
    return dist.sequence_rank(), dist.sequence_size()


class GRPOJob:
    kind = "grpo"

    def __init__(self, session, samples):
        cfg = session.cfg
        self.session, self.cfg = session, cfg
        self.ref = None  # with LoRA and no other model.ref_path: the policy's adapters-off forward (GRPOStep)
        ref_path = separate_reference(cfg.model) if cfg.algorithm.beta > 0 else None
        if ref_path:
            from mmpg.models.loading import load_policy
            from mmpg.train.engine import wrap_frozen

            ref = load_policy(ref_path, dtype=session.dtype, attn_implementation=cfg.model.attn_implementation,
                              device=session.device)
            grouping_options(ref, cfg)  # the reference's grouped forward: the policy's backend
            if session.sp > 1:  # the reference's grouped forward spreads its rows like the policy's
                from mmpg.grouping import apply_grouped_attention

                apply_grouped_attention(ref, sequence_group=dist.sequence_group())
            self.ref = wrap_frozen(ref, cfg, session.world, session.dtype)
        from mmpg.data.prompts import get_template

        template = get_template(cfg.data.template)
        self.position = int(session.state.get("data_position", 0))  # stream position of the next global batch
        cache = frame_cache(cfg)
        zoom = None
        if template.tools:  # multi-turn rollouts with the zoom tool (mmpg.rollout.multiturn)
            zoom = zoom_environment(cfg, session.family, cache)
        loader = make_train_loader(samples, video_spec(cfg, session.family), session.processor, template,
                                   global_batch=cfg.data.batch_size, rank=dist.data_rank(), world=dist.data_size(),
                                   seed=cfg.trainer.seed, shuffle=cfg.data.shuffle, start=self.position,
                                   num_workers=cfg.data.num_workers, strict=cfg.data.strict,
                                   queries_per_video=cfg.data.queries_per_video, frame_cache=cache,
                                   part=sequence_part(session))
        self.step_fn = GRPOStep(cfg, session.engine, self.ref, session.processor, loader,
                                make_scorer(cfg.reward, template.think), session.device, zoom=zoom)
        self.skipped_total = int(session.state.get("skipped_total", 0))  # unusable samples so far, all ranks
        from mmpg.grouping.backends import compute_dtype
        from mmpg.grouping.bounds import bound_for

        policy = self.step_fn.policy
        self.drift = DriftAlarm(bound_for(policy, compute_dtype(policy, policy.get_input_embeddings().weight.device)))
        self.sent_media: set[str] = set()
        self.eval_samples = None

    def trainer_state(self) -> dict:
        pos = self.position + self.step_fn.batches_trained * self.cfg.data.batch_size
        return {"data_position": pos, "skipped_total": self.skipped_total, "kind": self.kind}

    def _media(self, groups) -> list:
        count = self.cfg.logging.thumbnails
        out = []
        for g in groups:
            if count > 0 and g.video is not None and g.sample.video not in self.sent_media:
                self.sent_media.add(g.sample.video)
                out.append((g.sample.video, *thumbnails(g.video, count)))
        return out

    def train_step(self, step: int) -> StepOutput:
        sums, groups, info = self.step_fn.run(step)
        groups = [g for g in groups if not g.dummy]  # lockstep stand-ins are not the step's data
        # over the ranks holding different samples (the ranks of a sequence-parallel group hold the same)
        summaries = dist.gather_data([group_summary(g, step) for g in groups])
        infos = dist.gather_data(info)
        # the most frames one rank decoded (every rank: under sequence parallelism each decodes its part)
        frames_max = dist.all_max([float(info.get("frames_decoded", 0))], self.step_fn._coll_device)[0]
        write_rollouts = self.cfg.logging.rollouts_every > 0 and step % self.cfg.logging.rollouts_every == 0
        local_records = group_records(step, groups, 0, {}, self.cfg.logging.rollout_logprobs) if write_rollouts else []
        media = dist.gather_data(self._media(groups) if write_rollouts else [])
        records = dist.gather_data(local_records)
        flat = [r for rank_records in records for r in rank_records]
        for i, r in enumerate(flat):
            r.group_index = i
        self.skipped_total += sum(i["skipped"] for i in infos)  # the same on every rank
        if self.session.rank != 0:
            return StepOutput(metrics=None)
        metrics = step_metrics([s for part in summaries for s in part], sums, infos, self.skipped_total,
                               self.session.device)
        if self.cfg.rollout.max_staleness:
            metrics["timing_s/rollout_wait"] = max(i["timing"].get("rollout_wait", 0.0) for i in infos)
        metrics["data/split_videos"] = float(split_videos(summaries))
        metrics["data/frames_decoded_max"] = frames_max
        if self.cfg.rollout.engine == "vllm":
            metrics.update(vllm_metrics(infos))
        alarm = self.drift.update(step, metrics)
        if alarm:
            log.warning("%s", alarm)
        if self.cfg.rollout.tis_cap > 0 and "tis_weight" in sums:
            tokens = sums.get("tokens", 0.0)
            metrics["actor/tis_weight_mean"] = sums["tis_weight"] / tokens if tokens else 0.0
            metrics["actor/tis_capped"] = sums["tis_capped"] / tokens if tokens else 0.0
        return StepOutput(metrics=metrics, rollouts=flat, thumbnails=[m for part in media for m in part])

    def close(self) -> None:
        """The end of the run, or a failure: the rollout thread (rollout.max_staleness) stops pulling and sampling."""
        self.step_fn.close()

    def evaluate(self, step: int) -> dict | None:
        from mmpg.train.heldout import evaluate_heldout

        return evaluate_heldout(self, step)


def split_videos(summaries: list[list[dict]]) -> int:
    """Videos whose queries of this step were trained on more than one data-parallel rank (each such rank decoded,
    encoded and prefilled the video): `summaries` per rank, each group's `video`."""
    ranks: dict = {}
    for r, part in enumerate(summaries):
        for s in part:
            ranks.setdefault(s["video"], set()).add(r)
    return sum(len(r) > 1 for r in ranks.values())


def vllm_metrics(infos: list[dict]) -> dict:
    """timing_s/weight_sync (slowest rank: the others wait for rank 0) and what rank 0 sent."""
    sent = next((i["weight_sync"] for i in infos if i.get("weight_sync")), {})
    return {"timing_s/weight_sync": max(i["timing"].get("weight_sync", 0.0) for i in infos),
            "perf/weight_sync_mb": sent.get("bytes", 0) / 2 ** 20,
            "perf/weight_sync_server_s": sent.get("server_seconds", 0.0)}


def train(cfg: Config, command: list[str]) -> int:
    """Run (or resume) a GRPO job; returns the exit status."""
    check_grpo_config(cfg)
    if cfg.data.template == "zoom":  # the longest trajectory against the model's positions, before a run exists
        from transformers import AutoConfig

        from mmpg.models.loading import load_processor, resolve_checkpoint
        from mmpg.rollout.lengths import check_zoom_length

        path = resolve_checkpoint(cfg.model.path)  # a missing folder: one line
        check_zoom_length(cfg, AutoConfig.from_pretrained(path), load_processor(path))
    samples = load_train_samples(cfg)
    micro = cfg.trainer.micro_batch_size
    session = open_session(cfg, "grpo", command, micro_batch=micro,
                           total_updates=cfg.trainer.total_steps * cfg.algorithm.num_iterations)
    job = GRPOJob(session, samples)
    if session.start_step >= cfg.trainer.total_steps:
        log.info("nothing to do: the run is at step %d of %d", session.start_step, cfg.trainer.total_steps)
    run_loop(job, session)
    if session.rank == 0:
        print(f"[mmpg] run directory: {session.run_dir}", flush=True)
    return 0
