"""DeepSpeed engine set-up shared by every training job (GRPO, SFT): ZeRO 0-3, CPU (gloo) or GPUs (NCCL).

    engine = build_engine(model, cfg, world_size)   # deepspeed.DeepSpeedEngine around the policy
    engine.set_gradient_accumulation_boundary(last); engine.backward(loss, scale_wrt_gas=False); engine.step()

The training loop owns the loss scaling: every micro-batch loss is already divided by the global normaliser
(summed over micro-batches and ranks) and multiplied by the world size, because DeepSpeed averages gradients over
data-parallel ranks; `scale_wrt_gas=False` stops DeepSpeed dividing again by its accumulation count. The number of
micro-batches may change from step to step (skipped videos, dynamic sampling), so the loop marks the accumulation
boundary itself instead of relying on a fixed `gradient_accumulation_steps`.

Optimizer: torch AdamW handed to DeepSpeed (no op compilation, same maths on CPU and GPU); with `deepspeed.offload`
DeepSpeed's CPU Adam (the only optimizer ZeRO-Offload accepts). LR: linear warm-up, then constant, cosine or linear.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import torch

from mmpg import dist
from mmpg.errors import UserError

# What configs/deepspeed/zero{1,2,3}.json hold; used when deepspeed.config is empty.
_ZERO = {
    0: {"stage": 0},
    1: {"stage": 1},
    2: {"stage": 2, "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": 5e7},
    3: {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
        "stage3_gather_16bit_weights_on_model_save": True},
}


class TrainModule(torch.nn.Module):
    """The policy as DeepSpeed sees it. `engine(fn, *args)` runs `fn(policy, *args)` inside `engine.forward`, so a
    job's own loss computation (the grouped forward, which calls the policy's sub-modules itself) gets DeepSpeed's
    forward bookkeeping: ZeRO-3 micro-step counters and the backward prologue hooks on the output. (Calling the
    policy directly and then `engine.backward` silently drops every micro-batch gradient but the last under ZeRO-3.)
    """

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, fn, *args, **kwargs):
        return fn(self.policy, *args, **kwargs)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return name


def resolve_dtype_name(name: str, device: str) -> str:
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return name


def prepare_deepspeed_env(device: str) -> None:
    """DeepSpeed picks its accelerator at import; without CUDA it must be told to use the CPU one."""
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(".cache/torch_extensions").resolve()))
    # DeepSpeed JIT-builds ops with the first `ninja` on PATH. Two ninja versions (the venv's, the system's) hash
    # build commands differently, so processes started with and without the venv on PATH rebuild the op (1-2 min)
    # every time. Use the ninja installed beside this Python when there is one.
    bin_dir = Path(sys.executable).parent
    if (bin_dir / "ninja").is_file() and not os.environ.get("PATH", "").startswith(str(bin_dir) + os.pathsep):
        os.environ["PATH"] = str(bin_dir) + os.pathsep + os.environ.get("PATH", "")


def deepspeed_config(cfg, world_size: int, micro_batch: int, dtype: str) -> dict:
    """The DeepSpeed JSON for this run: the user's file (or the built-in ZeRO stage) with the batch sizes,
    clipping and precision that the mmpg config decides (DeepSpeed must not disagree with the loop)."""
    ds = cfg.deepspeed
    if ds.config:
        path = Path(ds.config)
        if not path.is_file():
            raise UserError(f"deepspeed.config: {ds.config}: file not found")
        try:
            conf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"deepspeed.config: {ds.config}: not valid JSON ({e})") from None
    else:
        conf = {"zero_optimization": dict(_ZERO[ds.zero_stage])}
    zero = conf.setdefault("zero_optimization", {"stage": 0})
    if ds.offload:
        zero.update(_ZERO[3] | {"stage": 3})
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if zero.get("stage", 0) == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    conf["train_micro_batch_size_per_gpu"] = micro_batch
    conf["gradient_accumulation_steps"] = 1  # the loop marks boundaries itself (see the module docstring)
    conf["train_batch_size"] = micro_batch * world_size
    conf["gradient_clipping"] = float(cfg.optim.max_grad_norm)
    conf["bf16"] = {"enabled": dtype == "bfloat16"}
    conf["fp16"] = {"enabled": False}
    if dtype == "float16":
        raise UserError("model.dtype=float16 is not supported for training (loss scaling); use bfloat16")
    conf.setdefault("zero_allow_untested_optimizer", True)
    conf.setdefault("steps_per_print", 10 ** 9)
    conf.setdefault("wall_clock_breakdown", False)
    return conf


def lr_lambda(total_updates: int, warmup: int, kind: str, min_ratio: float):
    """Multiplier of the peak LR at optimizer update u (0-based): linear warm-up over `warmup` updates, then
    constant, cosine or linear down to `min_ratio` at the last update (linear with min_ratio 0 and no warm-up:
    transformers' default `get_linear_schedule_with_warmup`, (T - u) / T, which TRL-based trainers inherit)."""
    def f(u: int) -> float:
        if warmup > 0 and u < warmup:
            return (u + 1) / warmup
        if kind == "constant":
            return 1.0
        span = max(1, total_updates - warmup)
        progress = min(1.0, (u - warmup) / span)
        if kind == "linear":
            return min_ratio + (1 - min_ratio) * (1 - progress)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def build_engine(model, cfg, world_size: int, micro_batch: int, dtype: str, total_updates: int):
    """Wrap `model` (already on its device, in its dtype) into a DeepSpeed engine with AdamW and the LR schedule.
    The engine's module is a `TrainModule`; the policy is `engine.module.policy`.

    Sequence parallelism (parallel.sequence_parallel_size) needs nothing of DeepSpeed here: every rank's gradient is
    a whole replica of its group's gradient (`mmpg.grouping.sequence`), so DeepSpeed averages over all ranks, in every
    ZeRO stage, exactly as over data-parallel ranks. (Handing DeepSpeed 0.19.8 its Ulysses groups object instead makes
    ZeRO 0-2 sum the sp ranks' gradients but ZeRO-3's default reduce-scatter average them: a run's gradient would
    depend on the stage.)"""
    import deepspeed

    conf = deepspeed_config(cfg, world_size, micro_batch, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    offload = conf["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu"
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                     adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total_updates, o.warmup_steps, o.scheduler, o.min_lr_ratio))
    engine, _, _, _ = deepspeed.initialize(model=TrainModule(model), optimizer=optimizer, lr_scheduler=schedule,
                                           config=conf, dist_init_required=world_size > 1)
    dist.release_shared_memory()  # DeepSpeed's CPU all-reduce files, which it leaves behind
    return engine


def wrap_frozen(model, cfg, world_size: int, dtype: str):
    """A frozen model (the KL reference) sharded like the policy under ZeRO-3; as it is otherwise."""
    conf = deepspeed_config(cfg, world_size, 1, dtype)
    if conf["zero_optimization"].get("stage", 0) != 3:
        return model.eval().requires_grad_(False)
    import deepspeed

    model.requires_grad_(False)
    conf["zero_optimization"].pop("offload_optimizer", None)
    engine, _, _, _ = deepspeed.initialize(model=model, config=conf, dist_init_required=world_size > 1)
    engine.module.eval()
    return engine.module


def is_zero3(engine) -> bool:
    return bool(getattr(engine, "zero_optimization_partition_weights", lambda: False)())


def full_state_dict(engine) -> dict | None:
    """The policy's whole weights on the CPU on rank 0 (None elsewhere), keyed as `policy.state_dict()`;
    collective under ZeRO-3 (gathered from every rank's partition)."""
    prefix = "policy."
    if is_zero3(engine):
        full = engine._zero3_consolidated_16bit_state_dict()
        return None if full is None else {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    return {k: v.detach().cpu() for k, v in engine.module.policy.state_dict().items()}


def adapter_state_dict(engine) -> dict | None:
    """The LoRA adapter tensors on the CPU on rank 0 (None elsewhere), keyed as peft's state dict
    (`mmpg.models.lora.adapter_parameters`); collective under ZeRO-3, where only these small tensors are gathered
    and the frozen base stays partitioned."""
    from mmpg.models.lora import adapter_parameters

    named = adapter_parameters(engine.module.policy)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    gather = contextlib.nullcontext()
    if is_zero3(engine):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None)
    with gather:
        return {n: p.detach().cpu().clone() for n, p in named} if rank0 else None


def stage0_grad_norm(engine) -> float | None:
    """Global gradient norm before clipping, for ZeRO stage 0 in float32 (DeepSpeed clips there without keeping
    the norm). After the boundary backward the gradients are already averaged over ranks."""
    if engine.zero_optimization_stage() != 0:
        return None
    grads = [p.grad for p in engine.module.policy.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
