"""Process-group set-up and the few collectives that training and evaluation share (gloo on CPU, NCCL on GPUs).

One process (no launcher) is a world of size 1 and every helper is then a no-op. Under `torchrun` or the `deepspeed`
launcher the usual RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR variables are read by `init`.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init(device: str, timeout_minutes: int = 30) -> tuple[int, int]:
    """Join the process group when launched with several processes. Returns (rank, world_size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        return rank(), world_size()
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if world > 1:
        dist.init_process_group(backend, timeout=timeout)
    else:  # DeepSpeed wants a process group even for one process: a private one, no launcher variables needed
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return rank(), world_size()


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _reduce(values: list[float], op, device) -> list[float]:
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_sum(values: list[float], device="cpu") -> list[float]:
    return _reduce(values, dist.ReduceOp.SUM, device)


def all_max(values: list[float], device="cpu") -> list[float]:
    return _reduce(values, dist.ReduceOp.MAX, device)


def all_min(values: list[float], device="cpu") -> list[float]:
    return _reduce(values, dist.ReduceOp.MIN, device)


def all_true(flag: bool, device="cpu") -> bool:
    """True when `flag` is True on every rank."""
    return bool(all_min([1.0 if flag else 0.0], device)[0] > 0)


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (pickled; for small per-step records)."""
    if not active():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if active():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
