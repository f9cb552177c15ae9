"""Checkpoints: an HF model folder any tool can load, plus the trainer state needed to continue exactly.

    checkpoints/step_00000040/
        config.json, model.safetensors, processor files  save_pretrained: the full weights, also under ZeRO-3 (LoRA:
                                                         the adapter in peft's format, base_model_name_or_path the
                                                         base's absolute path or hub id; merging is `mmpg export`'s)
        deepspeed/state/...                              engine.save_checkpoint: module, optimizer, LR schedule by rank
        trainer_state.json                               step, data position, mmpg layout version
        schedule.json                                    LR schedule position, DeepSpeed counters
        rng/rank_00000.pt                                torch / CUDA / numpy / python RNG states (tensors and lists
                                                         only: read with torch.load(weights_only=True))
        COMPLETE                                         written last, then the folder is renamed into place

Everything is written under checkpoints/.tmp-step_XXXXXXXX/ and renamed when complete, so a kill leaves a temporary
folder that readers and `--resume auto` ignore. Rank 0 checks first that the checkpoint fits the free disk
(`mmpg.runs.disk`) and every rank stops with one line if not; a write that fails anyway removes its temporary folder
and leaves the earlier checkpoints untouched. The optimizer state (deepspeed/, 12 bytes per trained parameter) is
kept as `checkpoint.optimizer_state` says (`last`: in the newest only; `all`; `none`); an older checkpoint loses it
only after a newer one is complete, by one rename of its deepspeed/ folder, so none is ever half-stripped. A resume
from a weights-only checkpoint restarts AdamW's moments from zero, continues the rest, and says so in one line.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from mmpg.errors import UserError
from mmpg.runs import finalize_checkpoint, latest_checkpoint, list_checkpoints, prune_checkpoints, temp_checkpoint_dir
from mmpg.runs.files import fsync_dir
from mmpg.runs.layout import CHECKPOINTS_DIR, TEMP_PREFIX
from mmpg import dist
from mmpg.models.lora import is_lora, resume_mismatch, save_adapter
from mmpg.runs import disk
from mmpg.train.engine import adapter_state_dict, full_state_dict

log = logging.getLogger("mmpg.train")

STATE_FILE = "trainer_state.json"
SCHEDULE_FILE = "schedule.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's; its presence marks a LoRA checkpoint
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DS_DIR = "deepspeed"  # the optimizer state; a checkpoint without it is weights-only
DS_TAG = "state"
OPTIMIZER_STATE = ("last", "all", "none")  # checkpoint.optimizer_state


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def engine_sizes(engine) -> disk.Sizes:
    """This run's checkpoint by part (`mmpg.runs.disk`), from the policy's parameter counts (ZeRO-3: ds_numel)."""
    policy = engine.module.policy
    params = list(policy.parameters())
    count = lambda p: int(getattr(p, "ds_numel", 0) or p.numel())  # noqa: E731
    n = sum(count(p) for p in params)
    trained = sum(count(p) for p in params if p.requires_grad)
    b = torch.finfo(params[0].dtype).bits // 8 if params else 4
    gpu = str(getattr(engine, "device", "cpu")).startswith("cuda")
    return disk.checkpoint_sizes(n, trained, b, engine.zero_optimization_stage(), dist.world_size(),
                                 lora=is_lora(policy), gpu=gpu)


def _check_space(run_dir: Path, step: int, engine, with_optimizer: bool) -> None:
    """Collective: one line on every rank when the checkpoint would not fit the free disk (rank 0 measures)."""
    problem = None
    if dist.rank() == 0:
        sizes = engine_sizes(engine)
        what = f"checkpoint step {step} ({'with' if with_optimizer else 'without'} optimizer state)"
        problem = disk.space_problem(sizes.full if with_optimizer else sizes.weights_only,
                                     Path(run_dir) / CHECKPOINTS_DIR, what)
    problem = dist.first_error(problem)
    if problem:
        raise UserError(problem)


def schedule_state(engine) -> dict:
    """What a weights-only resume needs besides the weights: the LR schedule's position and DeepSpeed's counters
    (small; JSON, so it is read without unpickling)."""
    sched = engine.lr_scheduler
    return {"lr_scheduler": sched.state_dict() if sched is not None else None,
            "global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
            "skipped_steps": int(engine.skipped_steps)}


def restore_schedule(engine, path: Path) -> int:
    """The LR schedule and counters of `schedule_state`, with the optimizer's LR set to the next update's (as a
    loaded optimizer state would carry it). Returns the optimizer updates done so far."""
    file = path / SCHEDULE_FILE
    if not file.is_file():
        raise UserError(f"{path}: weights-only checkpoint without {SCHEDULE_FILE}; resume from a checkpoint that "
                        "holds its optimizer state (deepspeed/), or train from its weights with model.path")
    saved = json.loads(file.read_text())
    sched = engine.lr_scheduler
    if sched is not None and saved["lr_scheduler"] is not None:
        sched.load_state_dict(saved["lr_scheduler"])
        for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
            group["lr"] = lr
    engine.global_steps, engine.global_samples = saved["global_steps"], saved["global_samples"]
    engine.skipped_steps = saved["skipped_steps"]
    return int(saved["global_steps"])


def _write(tmp: Path, engine, processor, with_optimizer: bool) -> None:
    rank = dist.rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    policy = engine.module.policy
    lora = is_lora(policy)
    state_dict = adapter_state_dict(engine) if lora else full_state_dict(engine)  # collective under ZeRO-3
    if rank == 0:
        if lora:
            save_adapter(policy, tmp, state_dict)
        else:
            policy.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        processor.save_pretrained(tmp)
        (tmp / SCHEDULE_FILE).write_text(json.dumps(schedule_state(engine), indent=1))
    if with_optimizer:  # with LoRA the frozen base is not copied into every checkpoint (it is model.path's)
        engine.save_checkpoint(str(tmp / DS_DIR), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=lora)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")


def save_checkpoint(run_dir: Path, step: int, engine, processor, trainer_state: dict, keep_last: int,
                    optimizer_state: str = "last") -> Path | None:
    """Collective: every rank calls it. Returns the final folder on rank 0. `optimizer_state`: last, all or none
    (checkpoint.optimizer_state, the module docstring)."""
    if optimizer_state not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATE}, got {optimizer_state!r}")
    with_optimizer = optimizer_state != "none"
    _check_space(run_dir, step, engine, with_optimizer)
    rank = dist.rank()
    tmp = temp_checkpoint_dir(run_dir, step)
    final = None
    try:
        _write(tmp, engine, processor, with_optimizer)
        dist.barrier()
        if rank == 0:
            state = dict(trainer_state, step=step, world_size=dist.world_size())
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            final = finalize_checkpoint(tmp, Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:08d}")
    except BaseException as err:
        problem = _failed_write(run_dir, step, tmp, err)
        if problem is None:
            raise
        raise UserError(problem) from err
    if rank == 0:
        prune_checkpoints(run_dir, keep_last)
        if optimizer_state == "last":
            for _, older in list_checkpoints(run_dir):
                if older != final:
                    drop_optimizer_state(older)
    dist.barrier()
    return final


FULL_DISK_BYTES = 64 * 2 ** 20  # less than this free after a failed write: the disk filled up


def _failed_write(run_dir: Path, step: int, tmp: Path, err: BaseException) -> str | None:
    """A write that failed part-way (a disk that filled up after the check, a quota): rank 0 removes the partial
    folder; a full disk becomes one line naming what is left (None: any other error, raised as it is)."""
    free, where = disk.free_bytes(tmp.parent)
    if dist.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    full = isinstance(err, OSError) or (isinstance(err, RuntimeError) and free < FULL_DISK_BYTES)
    if not full:
        return None
    last = latest_checkpoint(run_dir)
    kept = f"the last complete checkpoint {last[1]} is untouched" if last else "there is no earlier checkpoint"
    return (f"checkpoint step {step}: writing it failed ({err}) with {disk.gb(free)} free on {where}; the partial "
            f"folder was removed and {kept}. Free space there, or lower checkpoint.keep_last / "
            "checkpoint.optimizer_state")


def drop_optimizer_state(ckpt: Path) -> bool:
    """Make a complete checkpoint weights-only: its deepspeed/ folder renamed to a temporary name in one step, then
    deleted (a kill in between leaves a weights-only checkpoint and a leftover that the next call removes). Returns
    whether there was one."""
    for leftover in (p for p in ckpt.iterdir() if p.name.startswith(TEMP_PREFIX)):
        shutil.rmtree(leftover, ignore_errors=True)
    state = ckpt / DS_DIR
    if not state.is_dir():
        return False
    gone = ckpt / f"{TEMP_PREFIX}{DS_DIR}"
    os.replace(state, gone)
    fsync_dir(ckpt)
    shutil.rmtree(gone, ignore_errors=True)
    return True


def weights_only(path: Path | None) -> bool:
    """A checkpoint without its optimizer state (`checkpoint.optimizer_state`)."""
    return path is not None and not (Path(path) / DS_DIR).is_dir()


def policy_weights(model_path: str, resume: Path | None) -> tuple[str, Path | None]:
    """(the folder the policy is loaded from, the checkpoint whose LoRA adapter goes onto it): model.path and None,
    except for a resume from a weights-only checkpoint: its own full weights, or model.path and its adapter. Either
    way the DeepSpeed engine is then built around those weights, so its fp32 master copy starts from them."""
    if not weights_only(resume):
        return model_path, None
    if (resume / ADAPTER_CONFIG).is_file():
        return model_path, resume
    return str(resume), None


def adopt_weights(policy, resume: Path | None, adapter_from: Path | None) -> Path | None:
    """After loading the policy from `policy_weights`: the adapter of a weights-only LoRA checkpoint onto it.
    Returns the weights-only checkpoint the policy now holds (None otherwise), for `load_checkpoint(weights_from=)`:
    a weights-only resume must not continue from model.path's weights."""
    if adapter_from is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from mmpg.models.lora import lora_handle

        saved = load_file(str(adapter_from / ADAPTER_WEIGHTS))
        result = set_peft_model_state_dict(lora_handle(policy).peft, saved)
        if getattr(result, "unexpected_keys", None):
            raise UserError(f"{adapter_from}: its adapter does not fit this model (e.g. {result.unexpected_keys[0]}); "
                            "resume with the run's own model.path and model.lora settings")
    return resume if weights_only(resume) else None


def find_resume(resume: str, run_dir: Path) -> Path | None:
    """'' -> None; 'auto' -> the latest complete checkpoint of `run_dir` or None; a path -> that checkpoint."""
    if not resume:
        return None
    if resume == "auto":
        found = latest_checkpoint(run_dir) if Path(run_dir).is_dir() else None
        return found[1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file() or not (path / "COMPLETE").is_file():
        raise UserError(f"checkpoint.resume: {resume} is not a complete mmpg checkpoint (no {STATE_FILE} or "
                        "COMPLETE); give a checkpoints/step_XXXXXXXX folder or 'auto'")
    return path


def load_checkpoint(path: Path, engine, weights_from: Path | None = None) -> dict:
    """Restore module, optimizer, LR schedule and this rank's RNG; returns the trainer state dict. A weights-only
    checkpoint restores all but AdamW's moments: its weights were loaded with the policy (`policy_weights`), which
    `weights_from` (what `adopt_weights` returned) must say."""
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("world_size") != dist.world_size():
        raise UserError(f"{path}: saved with {state.get('world_size')} ranks, resumed with {dist.world_size()}; "
                        "resume with the same number of processes")
    lora = is_lora(engine.module.policy)
    if lora != (path / ADAPTER_CONFIG).is_file():
        raise UserError(f"{path}: saved {'without' if lora else 'with'} LoRA adapters, resumed with model.lora.r "
                        f"{'> 0' if lora else '= 0'}; resume with the run's own model.lora settings")
    if lora:
        mismatch = resume_mismatch(engine.module.policy, json.loads((path / ADAPTER_CONFIG).read_text()))
        if mismatch:
            raise UserError(f"{path}: its adapters are not this run's ({mismatch}); resume with the run's own "
                            "model.path and model.lora settings")
    if weights_only(path):
        if weights_from is None or str(weights_from) != str(path):
            raise RuntimeError(f"{path} is weights-only: load the policy through policy_weights / adopt_weights")
        updates = restore_schedule(engine, path)
        if dist.rank() == 0:
            print(f"[mmpg] {path} holds weights only (no deepspeed/ optimizer state; checkpoint.optimizer_state): "
                  f"resuming from its weights with AdamW's moments restarted from zero; the LR schedule continues "
                  f"at update {updates}", file=sys.stderr, flush=True)
    else:
        # LoRA: the DeepSpeed state holds the trainable tensors only; the frozen base comes from model.path
        load_path, _ = engine.load_checkpoint(str(path / DS_DIR), tag=DS_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True, load_module_strict=not lora)
        if load_path is None:
            raise UserError(f"{path}: DeepSpeed state could not be loaded from {path / DS_DIR}")
    rng_file = path / "rng" / f"rank_{dist.rank():05d}.pt"
    set_rng_state(torch.load(rng_file, weights_only=True))
    return state
