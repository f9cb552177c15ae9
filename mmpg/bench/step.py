"""Step-level variants: one whole GRPO step of the trainer on a random-weight video model, timed per phase.

    naive  `model.generate(num_return_sequences=G)` rollout (`GenerateEngine`), update with `repeated_logprobs`: the
           trainer with `algorithm.grouping=false` and a generate rollout
    mmpg   `HFEngine.generate_groups` rollout (each prompt prefilled once), update with `grouped_logprobs`
    tree   (Q > 1 queries of one video) the video's shared part forwarded once for all Q (`mmpg.grouping.shares`);
           "mmpg" is then per-query grouping (algorithm.share_videos=false)

One step is `mmpg.rl.grpo.GRPOStep.run` for one prompt (or the Q prompts of one video, `make_query_batch`) without
its data pull and dynamic sampling. Phases (`PHASES`), each timed with CUDA synchronised at both ends:
    rollout   G responses of exactly S tokens (no stop token: both variants decode as many tokens)
    reward    the built-in grounding reward plus a share of digits (a random policy never writes a parsable answer;
              the digits give the group a spread, so advantages and gradients are not 0)
    logprob   the frozen reference's logprobs for the KL term (beta > 0), no grad
    update    policy logprobs through the DeepSpeed engine (ZeRO 0, AdamW), loss, backward, optimizer step
    total     wall time of the step (timing_s/step), which also covers splitting groups and advantages (milliseconds)
Memory (the cold step only, `mmpg.bench.measure`): a phase's peak is its high-water mark minus the memory in use when
the step began. The vision tower is frozen (as `model.freeze_vision` defaults), so the update runs it forward only.
Case keys lora_r and ref ("copy" or "adapters_off") add the trainer's LoRA and pick the KL reference
(`mmpg.bench.lora`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import types
from collections.abc import Sequence

import torch

from mmpg.bench import memory as probes
from mmpg.grouping.inputs import pad_token_id
from mmpg.rollout.engine import FINISH_LENGTH, Rollout, RolloutEngine, SamplingParams

PHASES = ("rollout", "reward", "logprob", "update")
# the ceiling (a key of the row, see `mmpg.bench.runner.ceilings`) each phase's speed-up is compared with
PHASE_CEILINGS = {"rollout": "rho_rollout", "reward": None, "logprob": "rho_fwd", "update": "rho_flops",
                  "total": "rho_step"}


class GenerateEngine(RolloutEngine):
    """The naive rollout: `model.generate(num_return_sequences=G, do_sample=True)`, returned in the `Rollout` layout
    of `HFEngine` (rows of a prompt contiguous, completion ids/mask [N, S] right-padded, texts, finish reasons,
    logprobs). generate expands the prompt G times before the prefill; transformers >= 5 runs the vision tower once
    and repeats its output. Benchmark only: one group size for every prompt, and stop_token_ids=() (every row
    decodes exactly max_new_tokens, as `HFEngine` does with no stop token); `videos` ignored, as `HFEngine` does."""

    def __init__(self, model, tokenizer):
        from mmpg.grouping.inputs import placeholder_token_ids

        self.model, self.tokenizer = model, tokenizer
        self.banned = placeholder_token_ids(model) or None  # HFEngine never samples a vision placeholder either

    def generate_groups(self, prompt_inputs, group_size: int | Sequence[int], sampling: SamplingParams | None = None,
                        *, prompt_seeds: Sequence[int] | None = None, videos: Sequence | None = None) -> Rollout:
        if not isinstance(group_size, int) or sampling is None or sampling.stop_token_ids != ():
            raise ValueError("GenerateEngine takes one int group size and stop_token_ids=() (exactly S tokens)")
        S, n_prompts = sampling.max_new_tokens, int(prompt_inputs["input_ids"].shape[0])
        if prompt_seeds is not None:  # generate draws every row from one stream: seed it from the first prompt
            torch.manual_seed(int(prompt_seeds[0]))
        modes = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            with torch.no_grad():
                out = self.model.generate(
                    **prompt_inputs, num_return_sequences=group_size, do_sample=True,
                    temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                    max_new_tokens=S, min_new_tokens=S, suppress_tokens=self.banned,
                    pad_token_id=pad_token_id(self.model), return_dict_in_generate=True,
                    output_scores=sampling.logprobs)
        finally:
            for module, training in modes.items():
                module.training = training
        ids = out.sequences[:, -S:]  # [N, S]: every row has exactly S new tokens
        logprobs = None
        if sampling.logprobs:  # the processed scores: tempered, placeholders at -inf
            scores = torch.stack(out.scores, dim=1).float()  # [N, S, V]
            logprobs = scores.log_softmax(-1).gather(-1, ids[..., None])[..., 0].cpu()
        return Rollout(completion_ids=ids.cpu(), completion_mask=torch.ones_like(ids).cpu(),
                       group_sizes=[group_size] * n_prompts,
                       texts=self.tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True),
                       finish_reasons=[FINISH_LENGTH] * ids.shape[0], logprobs=logprobs)


class PhaseClock:
    """The `timer` `GRPOStep.update` takes: `with clock("update"): ...` adds the phase's wall seconds (CUDA
    synchronised at both ends) and, with memory=True, records its peak: the high-water during the phase (reset at
    its start) minus the memory in use when the step began (`with clock.step(): ...`); probes: `mmpg.bench.memory`."""

    def __init__(self, device: torch.device, memory: bool, release: bool = False):
        self.device, self.memory, self.release = device, memory, release and memory
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, int | None] = {}
        self.method, self.base = None, 0

    @contextlib.contextmanager
    def step(self):
        if self.memory:
            probes.release(self.device) if self.release else gc.collect()
            probes.sync(self.device)
            self.base = probes.in_use(self.device)
        probes.sync(self.device)
        t0 = time.perf_counter()
        yield self
        probes.sync(self.device)
        self.seconds["total"] = time.perf_counter() - t0
        if self.memory:
            seen = [p for p in self.peaks.values() if p is not None]
            self.peaks["total"] = max(seen) if seen else None

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.memory:
            if self.release:  # untimed: the freed pages of earlier phases leave the RSS (`probes.release`)
                probes.release(self.device)
            self.method, before = probes.reset_peak(self.device)
        probes.sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            probes.sync(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            if self.memory:
                peak, old = probes.peak_since(self.device, self.base, before), self.peaks.get(name)
                self.peaks[name] = peak if old is None else max(old, peak or 0)


def step_config(case: dict, grouping: bool, share: bool = True):
    """The trainer's config for the case: G = rollout.n responses of S tokens, one prompt (Q: the case's queries of
    one video) per step, one micro-batch of all the step's groups, ZeRO stage the case's `zero` (default 0), the KL term at `beta` (case, default
    0.04); `share`: algorithm.share_videos; parallel.sequence_parallel_size = the case's `sp` (default 1);
    algorithm.self_check = the case's `self_check` (default on, as the trainer runs); model.grouping_backend = the
    variant's backend (`mmpg:flash`; default auto)."""
    from mmpg.config import load_config

    G, S, Q = case["G"], case["S"], case.get("Q", 1)
    overrides = {"rollout.n": G, "rollout.max_new_tokens": S, "rollout.temperature": 1.0,
                 "trainer.micro_batch_size": Q * G, "data.batch_size": Q,
                 "algorithm.share_videos": str(share).lower(), "algorithm.grouping": str(grouping).lower(),
                 "algorithm.beta": case.get("beta", 0.04), "model.dtype": case.get("dtype", "float32"),
                 "deepspeed.zero_stage": case.get("zero", 0), "parallel.sequence_parallel_size": case.get("sp", 1),
                 "algorithm.self_check": case.get("self_check", "on"),
                 "model.grouping_backend": case.get("backend") or "auto"}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def bench_scorer(cfg):
    """The trainer's built-in reward plus the response's share of digits (see the module docstring)."""
    from mmpg.rl.rewards import Scored, make_scorer

    scorer = make_scorer(cfg.reward, think=True)

    def score(text: str, sample) -> Scored:
        out = scorer(text, sample)
        digits = sum(c.isdigit() for c in text) / max(1, len(text))
        return Scored(dict(out.rewards, overall=out.rewards["overall"] + digits, digits=digits), out.span)

    return score


def _add_lora(model, r: int, ref: str) -> None:
    """r > 0: the trainer's own LoRA (`mmpg.models.lora.apply_lora`: the LM's q,k,v,o,gate,up,down; alpha 2r, no
    dropout, seed 0) injected into `model`, everything but the adapters frozen; r = 0: the model untouched. ref
    "adapters_off" (the step is given no reference model, so `GRPOStep` takes the policy with its adapters switched
    off, as a LoRA run does) needs adapters: without them the policy is no reference."""
    if ref == "adapters_off" and r <= 0:
        raise ValueError("ref=adapters_off needs lora_r > 0 (without adapters the policy is no reference)")
    if r > 0:
        from mmpg.config import LoraConfig
        from mmpg.models import lora

        lora.apply_lora(model, LoraConfig(r=r, alpha=2 * r, dropout=0.0), "bench-model", freeze_vision=True, seed=0)


class StepRunner:
    """`runner(memory=False)` runs one GRPO step and returns {"seconds": {phase: s, "total": s}, "peak_bytes":
    {phase: bytes or None, "total": ...} or None, "mem_method", "info": {"response_tokens"}}. `phased` tells
    `mmpg.bench.measure` that the step times its own phases."""

    phased = True

    def __init__(self, grpo, rollout_engine, prompt: dict, samples: list, device: torch.device,
                 release: bool = False):
        self.grpo, self.rollout_engine, self.prompt, self.device = grpo, rollout_engine, prompt, device
        self.release = release  # `PhaseClock`'s: freed pages given back before each measured phase
        # what split_groups reads
        self.batch = types.SimpleNamespace(inputs=prompt, samples=samples, videos=[None] * len(samples))
        self.calls = 0
        self.stats: list[dict] = []  # the engine's last_stats of each step (prefills, prefix tokens)

    def __call__(self, memory: bool = False) -> dict:
        from mmpg.train.batch import split_groups
        from mmpg.rl.collect import prompt_seed
        from mmpg.rl.rewards import score_groups
        from mmpg.rollout import SamplingParams

        grpo, cfg = self.grpo, self.grpo.cfg
        self.calls += 1  # a new step: new seeds, new responses
        seeds = [prompt_seed(cfg.trainer.seed, self.calls, s.sample_id, 1) for s in self.batch.samples]
        sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                  top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, stop_token_ids=())
        clock = PhaseClock(self.device, memory, self.release)
        grpo.vision.take()  # count this step's vision-tower encodes only
        with clock.step():
            with clock("rollout"):
                rollout = self.rollout_engine.generate_groups(self.prompt, cfg.rollout.n, sampling,
                                                              prompt_seeds=seeds)
            groups = split_groups(grpo.policy, self.batch, rollout, seeds)
            with clock("reward"):
                score_groups(grpo.scorer, groups)
            grpo.advantages(groups)
            sums = grpo.update(groups, clock)
        missing = [p for p in PHASES if p not in clock.seconds]
        assert not missing, f"phases {missing} did not run (algorithm.beta must be > 0 for the logprob phase)"
        info = {"response_tokens": sum(int(g.completion_mask.sum()) for g in groups),
                "shared_prompts": grpo.shared_prompts,
                # videos the vision tower encoded over rollout, reference and update (not the self-check), and the
                # K/V the rollout's cache held after its last decode step (None for generate)
                "vision_calls": grpo.vision.take(), "kv_bytes": getattr(self.rollout_engine, "last_kv_bytes", None),
                # tokens of the longest packed row (or sequence-parallel shard) the update's grouped forward held
                "row_tokens": sums.get("row_tokens") if grpo.cfg.algorithm.grouping else None}
        stats = getattr(self.rollout_engine, "last_stats", None)
        if stats:
            info["rollout_stats"] = dict(stats)
        return {"seconds": clock.seconds, "peak_bytes": clock.peaks if memory else None, "mem_method": clock.method,
                "info": info}


def setup(case: dict, device: torch.device):
    """(None, runner, info): the model, its frozen reference copy, the DeepSpeed engine and `GRPOStep` are built
    here, outside every measurement; `runner()` is one GRPO step (`StepRunner`)."""
    from mmpg.bench.batch import forward_tokens, make_inputs, make_query_batch
    from mmpg.bench.flops import layout_tokens
    from mmpg.bench.model import build_model, set_generation_ids
    from mmpg.data.samples import GroundingSample
    from mmpg import dist
    from mmpg.train.engine import build_engine, prepare_deepspeed_env

    variant, sp = case["variant"], case.get("sp", 1)
    if sp > 1 and variant == "naive":
        raise NotImplementedError("the repeated forward does not spread its rows over sequence-parallel ranks")
    prepare_deepspeed_env(device.type)  # before deepspeed is imported (build_engine imports it)
    dist.init(device.type)  # one process: a private process group, as the trainer makes; under torchrun: the world
    if sp > 1 and dist.world_size() != sp:
        raise ValueError(f"the bench's sp={sp} step runs one sequence-parallel group: launch exactly {sp} processes "
                         f"(torchrun --nproc_per_node {sp}), not {dist.world_size()}")
    dist.set_sequence_parallel(sp)  # as `mmpg.train.setup.open_session` does
    from mmpg.rl.grpo import GRPOStep
    from mmpg.rl.trainer import check_grpo_config

    model, ids = build_model(case, device)
    if ids["video"] is None:
        raise ValueError(f"the step level needs a video model (qwen2_5_vl, qwen3_vl), got {case['family']!r}")
    set_generation_ids(model)
    if case.get("freeze_vision", True):
        model.model.visual.requires_grad_(False)
    Q = case.get("Q", 1)
    if Q > 1:
        prompt, info = make_query_batch(model, case, ids, device)
    else:
        prompt, _, _, info = make_inputs(model, case, ids, device)
    if variant == "tree" and Q < 2:
        raise ValueError("the tree variant needs Q >= 2 queries per video (--queries-per-video)")
    cfg = step_config(case, grouping=variant != "naive", share=variant == "tree")
    check_grpo_config(cfg)
    copied = cfg.algorithm.beta > 0 and case.get("ref", "copy") == "copy"
    ref = copy.deepcopy(model).eval().requires_grad_(False) if copied else None
    _add_lora(model, int(case.get("lora_r", 0)), case.get("ref", "copy"))  # case lora_r / ref (`mmpg.bench.lora`)
    from mmpg.train.setup import grouping_options

    for m in (model, ref) if ref is not None else (model,):  # model.grouping_backend, as the trainer sets it
        grouping_options(m, cfg)
    if sp > 1:  # every grouped forward (policy and reference) spreads its row, as the trainer sets it up
        from mmpg.grouping import apply_grouped_attention

        for m in (model, ref) if ref is not None else (model,):
            apply_grouped_attention(m, sequence_group=dist.sequence_group())
    engine = build_engine(model, cfg, world_size=dist.world_size(), micro_batch=cfg.trainer.micro_batch_size,
                          dtype=case.get("dtype", "float32"), total_updates=10 ** 6)
    grpo = GRPOStep(cfg, engine, ref, ids["tokenizer"], iter(()), bench_scorer(cfg), device.type)
    rollout_engine = grpo.rollout_engine if variant != "naive" else GenerateEngine(grpo.policy, ids["tokenizer"])
    samples = [GroundingSample(sample_id=f"bench#{q}", video="bench.mp4", duration=30.0,
                               query=f"the person opens door {q}", span=(4.0, 11.0)) for q in range(Q)]
    if Q > 1:  # the update's forward (`mmpg.bench.flops.layout_tokens`)
        layout = {"naive": "naive", "mmpg": "per_query", "tree": "tree"}[variant]
        info["tokens"] = int(layout_tokens(layout, info["P"], case["t"], case["S"], case["G"], Q))
    else:
        info["tokens"] = forward_tokens(info["P"], case["S"], case["G"], shared=variant == "mmpg")
    # what `mmpg.bench.sp` needs for its ceilings: the replicated bytes (gradient + AdamW's m, v per trainable
    # parameter) and the threads this rank computes on
    info.update(sp=sp, trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                threads=torch.get_num_threads())
    return None, StepRunner(grpo, rollout_engine, prompt, samples, device, case.get("release", False)), info
