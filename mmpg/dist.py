"""Process-group set-up and the few collectives that training and evaluation share (gloo on CPU, NCCL on GPUs).

One process (no launcher) is a world of size 1 and every helper is then a no-op. Under `torchrun` or the `deepspeed`
launcher the usual RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR variables are read by `init`. DeepSpeed's MPI and Slurm
launchers (scripts/train_grounding.sh's LAUNCHER=openmpi, mvapich, slurm) start each process with mpirun or srun and
set none of them: `adopt_launcher_ranks` takes the rank, world size and local rank from the launcher's own variables
(MASTER_ADDR / MASTER_PORT from the launch script), so such a world is never W worlds of one process.

Sequence parallelism (`set_sequence_parallel`): the world of W = dp x sp ranks is cut into dp groups of sp
consecutive ranks. The ranks of one sequence-parallel group hold the same samples and share each packed row
(`mmpg.grouping.sequence`); the data-parallel group of a rank is the ranks at its place in every group, which hold
different samples. What sums or gathers over the data (`data_sum`, `gather_data`, `data_rank`, `data_size`) goes
over the data-parallel group; what keeps ranks in lockstep (`all_max`, `all_true`) over the whole world.

    world 4, sp 2:   sequence groups {0, 1} {2, 3}      data groups {0, 2} {1, 3}
"""

from __future__ import annotations

import datetime
import os
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist


# (launcher, rank, world size, local rank) variables of the launchers that set no RANK / WORLD_SIZE / LOCAL_RANK.
# Slurm: SLURM_STEP_NUM_TASKS, which only a task of srun has (a batch script's own SLURM_NTASKS is not a world).
LAUNCHER_RANKS = (("Open MPI (mpirun)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                  ("MVAPICH (mpirun)", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
                  ("Slurm (srun)", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"))


def adopt_launcher_ranks(env=None) -> str | None:
    """Set RANK / WORLD_SIZE / LOCAL_RANK in `env` (default os.environ) from an MPI or srun launch of several
    processes that set none of them; returns the launcher's name, or None when there is nothing to adopt (a
    torchrun / DeepSpeed launch, one process). Raises UserError when MASTER_ADDR or MASTER_PORT is missing."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return None
    for name, rank_key, size_key, local_key in LAUNCHER_RANKS:
        if all(env.get(k, "").isdigit() for k in (rank_key, size_key, local_key)) and int(env[size_key]) > 1:
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
            if missing:
                from mmpg.errors import UserError

                raise UserError(f"started by {name} as rank {env[rank_key]} of {env[size_key]} without "
                                f"{' or '.join(missing)}: set them in every process's environment (the first node's "
                                "address and a free port; scripts/train_grounding.sh does with HOSTFILE and LAUNCHER)")
            env.update(RANK=env[rank_key], WORLD_SIZE=env[size_key], LOCAL_RANK=env[local_key])
            return name
    return None


def init(device: str, timeout_minutes: int = 30) -> tuple[int, int]:
    """Join the process group when launched with several processes. Returns (rank, world_size)."""
    adopt_launcher_ranks()
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


_SEQUENCE: dict = {"size": 1, "group": None, "data": None}


def set_sequence_parallel(sp: int) -> None:
    """Cut the world into sequence-parallel groups of sp consecutive ranks and make the data-parallel groups across
    them. Collective: every rank calls it with the same sp. sp = 1: no sequence parallelism."""
    world, me = world_size(), rank()
    if sp <= 1:
        _SEQUENCE.update(size=1, group=None, data=None)
        return
    if world % sp:
        raise ValueError(f"sequence_parallel_size={sp} does not divide the {world} ranks")
    sequence_group = data = None
    for g in range(world // sp):
        ranks = list(range(g * sp, (g + 1) * sp))
        group = dist.new_group(ranks) if sp < world else None
        if me in ranks:
            sequence_group = group if group is not None else dist.group.WORLD
    for place in range(sp):
        ranks = list(range(place, world, sp))
        group = dist.new_group(ranks) if len(ranks) < world else None
        if me in ranks:
            data = group if group is not None else dist.group.WORLD
    _SEQUENCE.update(size=sp, group=sequence_group, data=data)


def sequence_size() -> int:
    return _SEQUENCE["size"]


def sequence_group():
    """This rank's sequence-parallel group (None without sequence parallelism)."""
    return _SEQUENCE["group"]


def sequence_rank() -> int:
    return dist.get_rank(_SEQUENCE["group"]) if _SEQUENCE["group"] is not None else 0


def data_size() -> int:
    """Ranks that hold different samples: the world size / sp."""
    return world_size() // _SEQUENCE["size"]


def data_rank() -> int:
    """This rank's place among the ranks that hold different samples (its sequence-parallel group's index)."""
    return rank() // _SEQUENCE["size"]


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# A second group over every rank (gloo) for one background thread's collectives (`mmpg.rl.overlap`: the rollouts
# of the next steps, sampled while the main thread trains). Two threads must never share a group: their collectives
# would pair up across ranks in whatever order they happen to run.
_SIDE: dict = {"group": None}
_THREAD = threading.local()


def make_side_group() -> None:
    """Create the side group. Collective: every rank calls it, from the main thread, before the thread starts."""
    if active() and _SIDE["group"] is None:
        _SIDE["group"] = dist.new_group(backend="gloo")


@contextmanager
def side():
    """Within it, this thread's collectives of this module (world and data ones) run on the side group, on the CPU.
    Not with sequence parallelism (whose data group is not the world)."""
    if _SEQUENCE["size"] > 1:
        raise RuntimeError("dist.side() is not for sequence-parallel runs")
    _THREAD.side = True
    try:
        yield
    finally:
        _THREAD.side = False


def on_side() -> bool:
    """True in a thread inside `side()`: collectives go over the side group, tensors on the CPU."""
    return getattr(_THREAD, "side", False)


def _group(group):
    """`group` (None: the world), or the side group inside `side()`."""
    return _SIDE["group"] if on_side() and _SIDE["group"] is not None else group


def _reduce(values: list[float], op, device, group=None) -> list[float]:
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device="cpu" if on_side() else device)
    dist.all_reduce(t, op=op, group=_group(group))
    return t.tolist()


def all_sum(values: list[float], device="cpu") -> list[float]:
    return _reduce(values, dist.ReduceOp.SUM, device)


def data_sum(values: list[float], device="cpu") -> list[float]:
    """Sum over the ranks holding different samples (the world without sequence parallelism)."""
    return _reduce(values, dist.ReduceOp.SUM, device, _SEQUENCE["data"])


def all_max(values: list[float], device="cpu") -> list[float]:
    return _reduce(values, dist.ReduceOp.MAX, device)


def all_min(values: list[float], device="cpu") -> list[float]:
    return _reduce(values, dist.ReduceOp.MIN, device)


def all_true(flag: bool, device="cpu") -> bool:
    """True when `flag` is True on every rank."""
    return bool(all_min([1.0 if flag else 0.0], device)[0] > 0)


def first_error(message: str | None) -> str | None:
    """Each rank's error message (None: it went well) -> the first failing rank's message, the same on every rank
    (None when none failed). A collective: every rank calls it right after a step that may fail on some ranks only
    (rank 0's vLLM weight sync), so that the others learn of a failure at once, instead of waiting out the collective
    timeout in their next collective for a rank that gave up."""
    if not active():
        return message
    return next((m for m in gather_objects(message) if m), None)


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (pickled; for small per-step records)."""
    if not active():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj, group=_group(None))
    return out


def gather_data(obj) -> list:
    """[obj of data rank 0, obj of data rank 1, ...] over the ranks holding different samples (every rank of a
    sequence-parallel group holds the same; without sequence parallelism, `gather_objects`)."""
    if _SEQUENCE["data"] is None:
        return gather_objects(obj)
    out = [None] * data_size()
    dist.all_gather_object(out, obj, group=_group(_SEQUENCE["data"]))
    return out


def gather_sequence(obj) -> list:
    """[obj of each rank of this rank's sequence-parallel group], in group order."""
    if _SEQUENCE["group"] is None:
        return [obj]
    out = [None] * _SEQUENCE["size"]
    dist.all_gather_object(out, obj, group=_SEQUENCE["group"])
    return out


SHM_DIR = "/dev/shm"
SHM_BUFFER = "deepspeed_allreduce_buffer"  # DeepSpeed's name: <this>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>


def release_shared_memory() -> bool:
    """Unlink this rank's file of DeepSpeed's CPU all-reduce from SHM_DIR; True when there was one. Collective: every
    rank calls it once DeepSpeed's set-up (`deepspeed.initialize`) has returned.

    On the CPU, when every rank is on one machine (the launcher's LOCAL_SIZE equals the world size), DeepSpeed maps
    one shared-memory file per rank (about 67 MB), opens every other rank's before its set-up returns and never
    removes its own: each such run would leave them in memory until the machine restarts. After a barrier (every rank
    has opened every other's), the names are no longer needed; the mappings stay valid until the processes end."""
    local = os.environ.get("LOCAL_SIZE", "")
    if not local.isdigit() or int(local) != world_size() or not os.path.isdir(SHM_DIR):
        return False
    barrier()
    name = "_".join([SHM_BUFFER, str(os.getuid()), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                     str(rank())])
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:  # not the CPU's all-reduce (a GPU run), or already released
        return False
    return True


def barrier() -> None:
    if active():
        dist.barrier()


def shutdown() -> None:
    _SEQUENCE.update(size=1, group=None, data=None)
    _SIDE["group"] = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
