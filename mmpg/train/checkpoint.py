"""Checkpoints: an HF model folder any tool can load, plus the trainer state needed to continue exactly.

    checkpoints/step_00000040/
        config.json, model.safetensors, processor / tokenizer files    <- save_pretrained (full weights, also ZeRO-3)
        deepspeed/state/...                                              <- engine.save_checkpoint: module, optimizer,
                                                                            LR schedule, per rank
        trainer_state.json                                               <- step, data position, mmpg layout version
        rng/rank_00000.pt                                                <- torch / CUDA / numpy / python RNG states
        COMPLETE                                                         <- written last, then the folder is renamed

With LoRA (model.lora.r > 0) the model files are the adapter in peft's format instead of the full weights:

    checkpoints/step_00000040/
        adapter_config.json, adapter_model.safetensors   <- PeftModel.save_pretrained on rank 0 (adapter tensors
                                                             gathered under ZeRO-3); base_model_name_or_path is
                                                             the base checkpoint's absolute path (or hub id)
        processor / tokenizer files, deepspeed/ (trainable tensors only), trainer_state.json, rng/, COMPLETE

The merged full weights are `mmpg export`'s job, not the checkpoint's.

Everything is written under `checkpoints/.tmp-step_XXXXXXXX/` and renamed when complete (mmpg.runs), so a kill in the
middle leaves a temporary folder that readers and `--resume auto` ignore. The RNG files hold tensors and lists only
and are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from mmpg.errors import UserError
from mmpg.runs import finalize_checkpoint, latest_checkpoint, prune_checkpoints, temp_checkpoint_dir
from mmpg import dist
from mmpg.models.lora import is_lora, resume_mismatch, save_adapter
from mmpg.train.engine import adapter_state_dict, full_state_dict

STATE_FILE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's; its presence marks a LoRA checkpoint
DS_TAG = "state"


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


def save_checkpoint(run_dir: Path, step: int, engine, processor, trainer_state: dict, keep_last: int) -> Path | None:
    """Collective: every rank calls it. Returns the final folder on rank 0."""
    rank = dist.rank()
    tmp = temp_checkpoint_dir(run_dir, step)
    if rank == 0:
        if tmp.exists():
            import shutil

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
    # with LoRA the frozen base is not copied into every checkpoint (it is model.path's)
    engine.save_checkpoint(str(tmp / "deepspeed"), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=lora)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    dist.barrier()
    final = None
    if rank == 0:
        state = dict(trainer_state, step=step, world_size=dist.world_size())
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        final = finalize_checkpoint(tmp, Path(run_dir) / "checkpoints" / f"step_{step:08d}")
        prune_checkpoints(run_dir, keep_last)
    dist.barrier()
    return final


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


def load_checkpoint(path: Path, engine) -> dict:
    """Restore module, optimizer, LR schedule and this rank's RNG; returns the trainer state dict."""
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
    # LoRA: the DeepSpeed state holds the trainable tensors only; the frozen base comes from model.path
    load_path, _ = engine.load_checkpoint(str(path / "deepspeed"), tag=DS_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_strict=not lora)
    if load_path is None:
        raise UserError(f"{path}: DeepSpeed state could not be loaded from {path / 'deepspeed'}")
    rng_file = path / "rng" / f"rank_{dist.rank():05d}.pt"
    set_rng_state(torch.load(rng_file, weights_only=True))
    return state
