"""`mmpg sft`: supervised warm start. Each sample's target is the answer in the prompt's own format,

    <think>{sft.think}</think><answer>{start} to {end}</answer><|im_end|>      (no <think> part for answer_only)

and the loss is the token-mean negative log-likelihood of the target tokens only (the prompt and the video are
context), over the whole global batch: sum over micro-batches and ranks of -log p, divided by the number of target
tokens of the global batch. The forward is the grouped one with one "response" per prompt, so the LM head runs only
on target positions. Same config tree, DeepSpeed engine, run directory, step loop, checkpoints and resume as
`mmpg train` (`mmpg.train`); metrics: sft/loss, sft/target_tokens, actor/grad_norm, actor/lr, timing_s/* (data: the
slowest rank's wait for its batch and its prompts), data/videos_decoded|cached, data/frames_decoded_max (the most
frames one rank decoded from files: under sequence parallelism each rank decodes only the frames it encodes, its
1/sp of each video), perf/* (perf/videos: distinct videos of the step, perf/vision_calls: videos the vision tower
encoded, all ranks).
A rank whose whole slice of a global batch is unusable trains a weight-0 stand-in (a blank video) beside the
others' real micro-batches (ZeRO-3 lockstep), so W ranks update as one process does on the usable samples.

With `sft.trajectories` (the zoom tool's cold start, data.template=zoom) the samples are the file's trajectories and
each target is the whole multi-turn completion behind the overview prompt (`mmpg.sft.trajectories`): the model's
turns, each with its stop token, and the tool's turns with the clips the tool decodes now; the forward is the
trajectory tree (`grouped_logprobs(completion_visuals=)`) and the loss covers the model's own tokens only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from mmpg.config import Config
from mmpg.data.dataset import stand_in_batch, strict_error, video_key
from mmpg.data.prompts import get_template
from mmpg.errors import UserError
from mmpg.grouping.inputs import pad_token_id
from mmpg.models.vision_calls import VisionCalls
from mmpg.train.batch import PromptGroup, micro_batches
from mmpg.train.peak_memory import peak_memory_mb
from mmpg import dist
from mmpg.train.data import make_train_loader
from mmpg.train.engine import stage0_grad_norm
from mmpg.train.loop import StepOutput, run_loop
from mmpg.train.setup import (check_sequence_parallel, frame_cache, load_train_samples, open_session, video_spec,
                              zoom_environment)

log = logging.getLogger("mmpg.train")


def _number(x: float, decimals: int) -> str:
    text = f"{x:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def target_text(sample, think: str | None, decimals: int = 2) -> str:
    """The supervised answer for a sample, in the format the grounding reward and parser expect."""
    s, e = sample.span
    answer = f"<answer>{_number(s, decimals)} to {_number(e, decimals)}</answer>"
    return f"<think>{think}</think>{answer}" if think is not None else answer


class SFTJob:
    kind = "sft"

    def __init__(self, session, samples, trajectories=None):
        cfg = session.cfg
        self.session, self.cfg = session, cfg
        # a cold start's first stage (sft.list_tools false): the tool's schema left out of the prompt
        self.template = dataclasses.replace(get_template(cfg.data.template), list_tools=cfg.lists_tools(self.kind))
        self.position = int(session.state.get("data_position", 0))
        cache = frame_cache(cfg)
        self.trajectories, self.env = None, None
        if trajectories is not None:  # sft.trajectories: the targets are whole multi-turn completions
            self.trajectories = {t.sample.sample_id: t for t in trajectories}
            self.env = zoom_environment(cfg, session.family, cache)
        loader = make_train_loader(samples, video_spec(cfg, session.family), session.processor, self.template,
                                   global_batch=cfg.data.batch_size, rank=dist.data_rank(), world=dist.data_size(),
                                   seed=cfg.trainer.seed, shuffle=cfg.data.shuffle, start=self.position,
                                   num_workers=cfg.data.num_workers, strict=cfg.data.strict,
                                   queries_per_video=cfg.data.queries_per_video, frame_cache=cache,
                                   part=(dist.sequence_rank(), dist.sequence_size()))  # sp > 1: only its frames
        self.batches, self.pulled = iter(loader), 0
        self.skipped_total = int(session.state.get("skipped_total", 0))
        self.tokenizer = getattr(session.processor, "tokenizer", session.processor)
        eos = session.model.generation_config.eos_token_id
        self.stop_id = eos if isinstance(eos, int) else eos[0]
        self.pad_id = pad_token_id(session.model)  # as the GRPO collator pads (masked positions only)
        self.coll = "cuda" if session.device == "cuda" and dist.active() else "cpu"
        self.eval_samples = None
        self.vision = VisionCalls(session.model)  # perf/vision_calls

    def trainer_state(self) -> dict:
        return {"data_position": self.position + self.pulled * self.cfg.data.batch_size,
                "skipped_total": self.skipped_total, "kind": self.kind}

    def _groups(self, batch) -> list[PromptGroup]:
        """One PromptGroup per sample: its prompt and its target as the single 'response' [1, T]."""
        from mmpg.grouping.inputs import prompt_attention_mask, split_visuals_per_prompt

        think = self.cfg.sft.think if self.template.think else None
        attn = prompt_attention_mask(batch.inputs)
        visuals = split_visuals_per_prompt(self.session.model, batch.inputs)
        groups = []
        for b, sample in enumerate(batch.samples):
            own, clips = None, None
            trajectory = self.trajectories.get(sample.sample_id) if self.trajectories is not None else None
            if trajectory is not None:  # the whole conversation after the prompt; the loss on the model's turns
                from mmpg.sft.trajectories import trajectory_completion

                target, own, clip = trajectory_completion(self.session.processor, trajectory, self.env, self.stop_id)
                target, own, clips = target[None], own[None], [clip]
            else:  # a single answer (also the stand-in's)
                target = torch.tensor([self.tokenizer(target_text(sample, think, self.cfg.sft.decimals),
                                                      add_special_tokens=False)["input_ids"] + [self.stop_id]])
            one = {k: batch.inputs[k][b:b + 1, attn[b]] for k in ("input_ids", "attention_mask", "mm_token_type_ids")
                   if batch.inputs.get(k) is not None}
            one.update(visuals[b])
            groups.append(PromptGroup(
                sample=sample, video=None, inputs=one, completion_ids=target, completion_mask=torch.ones_like(target),
                rollout_logprobs=torch.zeros(target.shape, dtype=torch.float32), texts=[""], finish_reasons=["stop"],
                advantages=torch.zeros(1), own_mask=own, completion_visuals=clips))
        return groups

    def _stand_in(self) -> list[PromptGroup]:
        """This rank's whole slice of the global batch was unusable: one weight-0 group about a blank video
        (`stand_in_batch`) keeps it in every forward and backward of the others (ZeRO-3 gathers weights in each).
        Its tokens are in neither the loss nor the token count, so the update is the one of the usable samples,
        as one process computes it on the same global batch."""
        (group,) = self._groups(stand_in_batch(self.session.processor, self.template))
        group.dummy = True
        return [group]

    @staticmethod
    def _nll(policy, mb, chunk):
        from mmpg.grouping import grouped_logprobs

        return grouped_logprobs(policy, mb.inputs, mb.completion_ids, mb.completion_mask, mb.group_sizes,
                                chunk_size=chunk, completion_visuals=mb.completion_visuals)

    def train_step(self, step: int) -> StepOutput:
        t0 = time.perf_counter()
        self.vision.take()  # count this step's encodes only
        batch = next(self.batches)
        self.pulled += 1
        if batch.skipped and self.cfg.data.strict:
            raise strict_error(batch.skipped[0])
        groups = self._groups(batch) if len(batch) else self._stand_in()
        t_data = time.perf_counter() - t0
        engine = self.session.engine
        mbs = micro_batches(groups, max(1, self.cfg.trainer.micro_batch_size), self.pad_id)
        target = int(dist.all_max([len(mbs)], self.coll)[0])
        while len(mbs) < target:  # lockstep filler (ZeRO-3), weight 0
            mbs.append(micro_batches(groups[:1], 1, self.pad_id)[0])
            mbs[-1].dummy = True
        tokens = dist.data_sum([sum(float(mb.own_mask.sum()) for mb in mbs if not mb.dummy)], self.coll)[0]
        if tokens == 0:  # no rank has a usable sample (nor would one process): nothing to train on
            raise UserError("a whole global batch of unusable videos; check the data with mmpg check-data")
        loss_sum = 0.0
        for i, mb in enumerate(mbs):
            engine.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            logp = engine(self._nll, mb, 2048)
            mask = mb.own_mask.to(logp.device).float() * (0.0 if mb.dummy else 1.0)
            loss = -(logp * mask).sum() / tokens
            engine.backward(loss * dist.data_size(), scale_wrt_gas=False)  # DeepSpeed averages over data ranks
            own_norm = stage0_grad_norm(engine) if i == len(mbs) - 1 else None
            engine.step()
            loss_sum += float(loss)
        infos = dist.gather_data({"skipped": len(batch.skipped), "prompt_tokens": sum(
            int(g.inputs["input_ids"].shape[1]) for g in groups if not g.dummy), "vision_calls": self.vision.take(),
            "videos": {video_key(s) for s in batch.samples}, "data_s": t_data, "decode": batch.decode_stats})
        self.skipped_total += sum(i["skipped"] for i in infos)
        loss_total = dist.data_sum([loss_sum], self.coll)[0]
        frames_max = dist.all_max([float(batch.decoded_frames)], self.coll)[0]  # every rank, sp ones included
        if self.session.rank != 0:
            return StepOutput(metrics=None)
        norm = engine.get_global_grad_norm()
        norm = own_norm if norm is None else norm
        step_s = time.perf_counter() - t0
        all_tokens = tokens + sum(i["prompt_tokens"] for i in infos)
        metrics = {"sft/loss": loss_total, "sft/target_tokens": tokens,
                   "actor/grad_norm": float(norm) if norm is not None else float("nan"),
                   "actor/lr": float(engine.get_lr()[0]), "data/skipped": float(sum(i["skipped"] for i in infos)),
                   "data/skipped_total": float(self.skipped_total),
                   "timing_s/data": max(i["data_s"] for i in infos),  # the slowest data rank's
                   "timing_s/update": step_s - t_data, "timing_s/step": step_s,
                   "perf/tokens_per_s": all_tokens / step_s, "perf/peak_memory_mb": peak_memory_mb(
                       self.session.device), "perf/videos": float(len(set().union(*(i["videos"] for i in infos)))),
                   "perf/vision_calls": float(sum(i["vision_calls"] for i in infos))}
        for kind in ("decoded", "cached"):  # data/videos_*: how the batches got their videos, all data ranks
            metrics[f"data/videos_{kind}"] = float(sum(int(i["decode"].get(kind, 0)) for i in infos))
        metrics["data/frames_decoded_max"] = frames_max
        return StepOutput(metrics=metrics)

    def evaluate(self, step: int) -> dict | None:
        from mmpg.train.heldout import evaluate_heldout

        return evaluate_heldout(self, step)


def sft(cfg: Config, command: list[str]) -> int:
    """Run (or resume) a supervised warm start; returns the exit status."""
    check_sequence_parallel(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # the launcher's; no process group yet
    trajectories = None
    if cfg.sft.trajectories:
        from mmpg.sft.trajectories import load_trajectories
        from mmpg.train.setup import check_video_budget

        check_video_budget(cfg)
        trajectories = load_trajectories(cfg.sft.trajectories, cfg.data.videos or None)
        if cfg.data.max_samples > 0:
            trajectories = trajectories[:cfg.data.max_samples]
        samples = [t.sample for t in trajectories]
    else:
        samples = load_train_samples(cfg)
    micro = cfg.trainer.micro_batch_size
    session = open_session(cfg, "sft", command, micro_batch=micro, total_updates=cfg.trainer.total_steps)
    run_loop(SFTJob(session, samples, trajectories), session)
    if session.rank == 0:
        print(f"[mmpg] run directory: {session.run_dir}", flush=True)
    return 0
