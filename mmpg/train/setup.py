"""What every training job does before its first step: device, process group, run directory, resume point,
policy + processor, the DeepSpeed engine, the training samples, the run writer and the log file."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

from mmpg.config import to_yaml
from mmpg.errors import UserError
from mmpg.models.loading import attention_summary
from mmpg.models.lora import trainable_summary
from mmpg.runs import METRICS_JSONL, RUN_JSON, TRAIN_LOG, RunWriter
from mmpg import choices, dist
from mmpg.train.checkpoint import find_resume, load_checkpoint
from mmpg.train import peak_memory
from mmpg.train.engine import build_engine, prepare_deepspeed_env, resolve_device, resolve_dtype_name

log = logging.getLogger("mmpg.train")


@dataclasses.dataclass
class Session:
    """The pieces a job's steps use; built by `open_session`."""

    cfg: object
    device: str
    dtype: str
    rank: int
    world: int
    run_dir: Path
    model: object  # the policy (engine.module.policy)
    processor: object
    engine: object
    family: str
    writer: RunWriter
    sp: int = 1  # parallel.sequence_parallel_size: ranks sharing each packed row (mmpg.dist)
    start_step: int = 0  # last completed step (0 for a fresh run)
    state: dict = dataclasses.field(default_factory=dict)  # trainer state of the resumed checkpoint


def _run_dir(cfg, kind: str, command: list[str]) -> Path:
    name = cfg.trainer.run_name
    if not name and cfg.checkpoint.resume == "auto" and dist.rank() == 0:  # the newest run of this config, said so
        from mmpg.train.resume import run_to_continue

        name, line = run_to_continue(cfg.trainer.output_dir, kind, command)
        print(f"[mmpg] {line}", file=sys.stderr, flush=True)
    name = name or time.strftime("%Y%m%d-%H%M%S")
    name = dist.gather_objects(name)[0]  # every rank uses rank 0's name (time stamps may differ)
    return Path(cfg.trainer.output_dir) / name


def resume_point(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint the run continues from (checkpoint.resume: '', 'auto' or a checkpoint folder), None for a
    fresh run. A folder that already holds a run is never started over: without a checkpoint to continue from,
    one line says what to do (with 'auto', a fresh name starts a run and a used one continues it, as a rerun of the
    same command does in verl and EasyR1)."""
    found = find_resume(resume, run_dir)
    if found is None and ((run_dir / METRICS_JSONL).exists() or (run_dir / RUN_JSON).exists()):
        if resume == "auto":
            raise UserError(f"{run_dir} holds a run with no complete checkpoint to continue from (it stopped before "
                            f"its first checkpoint.every_n_steps save); remove it to start over (rm -r {run_dir}) "
                            "or choose another trainer.run_name")
        raise UserError(f"{run_dir} already holds a run; continue it with checkpoint.resume=auto (--resume auto) "
                        "or choose another trainer.run_name")
    return found


def _setup_logging(run_dir: Path, rank: int) -> None:
    root = logging.getLogger("mmpg")
    root.setLevel(logging.INFO)
    if rank != 0:
        root.setLevel(logging.WARNING)
        return
    for h in list(root.handlers):
        if getattr(h, "_mmpg", False):
            root.removeHandler(h)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in (logging.FileHandler(run_dir / TRAIN_LOG), logging.StreamHandler(sys.stderr)):
        handler.setFormatter(fmt)
        handler._mmpg = True
        root.addHandler(handler)


def model_family(model) -> str:
    kind = model.config.model_type
    if kind not in ("qwen2_5_vl", "qwen3_vl"):
        raise UserError(f"model.path holds a {kind!r} model; grounding training needs a video model "
                        "(qwen2_5_vl or qwen3_vl)")
    return kind


def grouping_options(model, cfg):
    """model.grouping_backend and model.deterministic onto a loaded policy or reference (`mmpg.grouping`: read at each
    grouped forward); with model.deterministic, transformers' own flash_attention_2 runs deterministic too."""
    from mmpg.grouping import set_grouping_options

    if cfg.model.deterministic:
        os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    return set_grouping_options(model, backend=cfg.model.grouping_backend, deterministic=cfg.model.deterministic)


def record_grouped_backend(model, device: str) -> str:
    """`mmpg.choices` "grouped_backend": model.grouping_backend resolved for this device and dtype (the self-check
    records a fallback later)."""
    import torch

    from mmpg.grouping.backends import compute_dtype, resolve_backend

    dev = torch.device(device)
    from mmpg.grouping import grouping_state

    name = grouping_state(model).backend
    dtype = compute_dtype(model, dev)
    chosen = resolve_backend(name, dev, dtype)
    where = f"{dev.type} in {str(dtype).removeprefix('torch.')}"
    why = "" if name == chosen else f"model.grouping_backend={name} on {where}"
    choices.record("grouped_backend", chosen, why)
    return chosen


def load_models(cfg, device: str, dtype: str, resume: Path | None = None):
    """(policy, processor, the weights-only checkpoint the policy's weights came from or None): a resume from a
    weights-only checkpoint loads the policy's weights from it."""
    from mmpg.models.loading import load_policy, load_processor
    from mmpg.train.checkpoint import adopt_weights, policy_weights

    folder = Path(cfg.model.path).expanduser()
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise UserError(f"model.path: {cfg.model.path} is a LoRA adapter checkpoint, not a model; merge it into "
                        "its base first (mmpg export), or train from its base with model.lora")
    processor = load_processor(cfg.model.path)
    weights, adapter = policy_weights(cfg.model.path, resume)
    model = load_policy(weights, dtype=dtype, attn_implementation=cfg.model.attn_implementation,
                        gradient_checkpointing=cfg.model.gradient_checkpointing,
                        freeze_vision=cfg.model.freeze_vision, device=device, lora=cfg.model.lora,
                        seed=cfg.trainer.seed, train_merger=cfg.model.train_merger)
    return model, processor, adopt_weights(model, resume, adapter)


def open_session(cfg, kind: str, command: list[str], micro_batch: int, total_updates: int) -> Session:
    """Everything up to the first step. Raises UserError on bad input before anything is written."""
    if not cfg.model.path:
        raise UserError("model.path is required (a checkpoint folder; mmpg make-tiny builds a tiny one)")
    if cfg.logging.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError("logging.wandb=true but the wandb package is not installed; pip install wandb, or "
                            "turn it off") from None
    device = resolve_device(cfg.trainer.device)
    dtype = resolve_dtype_name(cfg.model.dtype, device)
    prepare_deepspeed_env(device)
    rank, world = dist.init(device, cfg.deepspeed.timeout_minutes)
    sp = cfg.parallel.sequence_parallel_size
    dist.set_sequence_parallel(sp)  # groups of sp consecutive ranks share each packed row
    run_dir = _run_dir(cfg, kind, command)
    resume = resume_point(cfg.checkpoint.resume, run_dir)
    model_record = same_model_everywhere(cfg)
    memory = peak_memory.start(device)  # before the model: perf/peak_memory_mb on a CPU counts from here
    model, processor, weights_from = load_models(cfg, device, dtype, resume)
    family = model_family(model)
    params = trainable_summary(model)  # before DeepSpeed partitions anything
    grouping_options(model, cfg)
    record_grouped_backend(model, device)
    if sp > 1:  # every grouped forward of this policy spreads its packed row over the sequence-parallel group
        from mmpg.grouping import apply_grouped_attention

        apply_grouped_attention(model, sequence_group=dist.sequence_group())
    engine = build_engine(model, cfg, world, micro_batch, dtype, total_updates)
    start, state = 0, {}
    if resume is not None:
        state = load_checkpoint(resume, engine, weights_from)
        start = int(state["step"])
    writer = RunWriter(run_dir, rank=rank, tensorboard=cfg.logging.tensorboard)
    config_yaml = f"{to_yaml(cfg)}# {params['text']}\n"  # the count as a comment: YAML readers skip it
    writer.start(config_yaml, kind=kind, command=command, resume_step=start if resume is not None else None,
                 extra={"parameters": params, "sequence_parallel_size": sp, "device": device,
                        "devices": world, "peak_memory": {**memory, "from_step": start + 1}, "model": model_record})
    _setup_logging(run_dir, rank)
    if rank == 0:
        print(f"[mmpg] resolved config ({kind}):\n{config_yaml}", flush=True)
        log.info("%s", params["text"])
        log.info("run directory %s; %s, %s, %d rank(s)%s, ZeRO stage %s%s", run_dir, device, dtype, world,
                 f" = {world // sp} data-parallel x {sp} sequence-parallel" if sp > 1 else "",
                 engine.zero_optimization_stage(), f"; resumed from {resume} (step {start})" if resume else "")
        log.info("attention: %s", attention_summary(model, device))
        log.info("fast paths: %s", choices.summary() or "none chosen yet")
    return Session(cfg=cfg, device=device, dtype=dtype, rank=rank, world=world, run_dir=run_dir,
                   model=engine.module.policy, processor=processor, engine=engine, family=family, writer=writer,
                   sp=sp, start_step=start, state=state)


def same_model_everywhere(cfg) -> dict:
    """run.json's "model" (`mmpg.models.hub.ResolvedModel.record`: model.path, its folder, hub id and commit). A hub
    id resolves to each node's cached revision: every rank must have the same one, or the ranks would train
    different weights; one line names them."""
    from mmpg.models.hub import hub_command, identify

    found = identify(cfg.model.path)
    revisions = dist.gather_objects(found.revision)
    if len(set(revisions)) > 1:
        where = ", ".join(f"{r} on rank {revisions.index(r)}" for r in dict.fromkeys(revisions))
        fetch = hub_command(f"download {found.repo_id or cfg.model.path} --revision {revisions[0]}")
        raise UserError(f"model.path {cfg.model.path} resolves to different revisions ({where}): the nodes' "
                        f"Hugging Face caches differ; run `{fetch}` on every node, or share one cache (HF_HOME)")
    return found.record()


def _model_config(cfg) -> dict | None:
    """model.path's config.json (nothing loaded; a hub id's from its snapshot, downloaded first where needed), or None
    when it cannot be read (loading then says why)."""
    import json

    from mmpg.models.hub import is_hub_id, local_folder

    path = cfg.model.path
    folder = Path(local_folder(path)) if is_hub_id(path) else Path(path).expanduser()
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def check_sequence_parallel(cfg, world: int) -> int:
    """parallel.sequence_parallel_size against the launcher's ranks, the model's attention heads (read from
    model.path's config.json) and the settings that cannot run under it: one UserError line each, before anything
    is loaded or written. Returns the number of data-parallel ranks (world / sp)."""
    from mmpg.grouping.ulysses import check_heads

    sp = cfg.parallel.sequence_parallel_size
    if sp <= 1:
        return world
    if world % sp:
        raise UserError(f"parallel.sequence_parallel_size={sp} does not divide the {world} launched ranks; launch a "
                        f"multiple of {sp} processes")
    if not getattr(cfg.algorithm, "grouping", True):
        raise UserError(f"parallel.sequence_parallel_size={sp} needs algorithm.grouping=true (the repeated forward "
                        "does not spread its rows over ranks)")
    config = _model_config(cfg) or {}
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads")
    if heads:
        problem = check_heads(int(heads), int(text.get("num_key_value_heads") or heads), sp)
        if problem:
            raise UserError(f"parallel.sequence_parallel_size={sp}: {problem} ({cfg.model.path})")
    return world // sp


def check_video_budget(cfg) -> None:
    """The frame and pixel budgets (data.*) checked against the model's patch size (read from model.path's
    config.json, nothing loaded): one line naming the keys and the range, before any video is touched."""
    family = (_model_config(cfg) or {}).get("model_type")
    if family not in ("qwen2_5_vl", "qwen3_vl"):
        return
    problem = video_spec(cfg, family).budget_problem("data.")
    if problem:
        raise UserError(f"{problem} ({family})")


def load_train_samples(cfg):
    """The training samples (annotation problems: counted skips, or an error in strict mode)."""
    from mmpg.data.formats import load_annotations

    check_video_budget(cfg)
    if not cfg.data.train:
        raise UserError("data.train is required (an annotation file)")
    result = load_annotations(cfg.data.train, cfg.data.videos or None, fmt=cfg.data.format, strict=cfg.data.strict)
    for skip in result.skipped[:20]:
        log.warning("annotation skipped: %s: %s", skip.where, skip.reason)
    if result.skipped:
        log.warning("%d annotation(s) skipped in %s", len(result.skipped), cfg.data.train)
    samples = result.samples[:cfg.data.max_samples] if cfg.data.max_samples > 0 else result.samples
    if not samples:
        raise UserError(f"{cfg.data.train}: no usable samples")
    return samples


def video_spec(cfg, family: str):
    from mmpg.data.video import VideoSpec

    d = cfg.data
    return VideoSpec.for_family(family, fps=d.fps, min_frames=d.min_frames, max_frames=d.max_frames,
                                min_pixels=d.min_pixels, max_pixels=d.max_pixels, total_pixels=d.total_pixels)


def zoom_environment(cfg, family: str, cache=None):
    """The zoom tool of data.template=zoom (zoom.fps, zoom.max_frames, zoom.max_turns; frames sized as data.*),
    decoding through the frame cache `cache` where one is open."""
    from mmpg.rollout.zoom import ZoomEnvironment, ZoomSettings

    return ZoomEnvironment(ZoomSettings(cfg.zoom.fps, cfg.zoom.max_frames, cfg.zoom.max_turns), video_spec(cfg, family),
                           decode=cache.frames if cache is not None else None)


def frame_cache(cfg):
    """The decoded-frame cache of data.frame_cache (capped at data.frame_cache_gb), or None when it is off."""
    from mmpg.data.frame_cache import open_frame_cache

    return open_frame_cache(cfg.data.frame_cache, cfg.data.frame_cache_gb)
