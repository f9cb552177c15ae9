"""GPU weight sync to the vLLM server over NCCL, without importing vllm here. UNTESTED on a GPU: its failure paths are
tested on the CPU with a refusing server and a stand-in NCCL peer (`tests/test_vllm_nccl.py`), the GPU path by
`tests/test_vllm_gpu.py` (markers gpu, vllm) on a machine with GPUs and the vLLM environment.

vLLM's RL weight transfer (NCCL backend) lets a trainer that cannot import vLLM join by NCCL unique id:

    trainer (rank 0)                                     server workers (ranks 1..W)
    uid = torch.cuda.nccl.unique_id()
    POST /init_weight_transfer {uid (base64), world} ->  ncclCommInitRank(uid, rank)   (concurrently with ours)
    init_rank(world, uid, 0); one-element all_reduce     their warm-up all_reduce (the handshake vLLM requires)
    POST /update_weights_nccl {names, dtypes, shapes} -> start, receive one broadcast per tensor, load_weights, finish
    broadcast(tensor, root 0) for each, in that order

A pool of servers is one group: server i's workers join at rank 1 + the workers of servers 0..i-1 ("rank_offset"),
each server gets its own two POSTs at once, and each tensor is broadcast once for all of them.

Bounded: the HTTP call and the NCCL side each run on a daemon thread, waited for with one deadline
(`rollout.vllm_sync_timeout_s`; the server is told the same). A refusal ends the wait at once, silence at the
deadline: a `ServerError` of one line naming the server and what to do, never a hang. NCCL cannot cancel a
rendezvous, so a thread left inside one stays there (a daemon) and the sender refuses every later send.
Which path a server's syncs take, file or NCCL, is decided once from its /health (`plan_weight_sync`).
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from mmpg.serve.wire import ServerError, call

log = logging.getLogger("mmpg.rollout.vllm")
SYNC_TIMEOUT_S = 300.0  # rollout.vllm_sync_timeout_s' default: a 7B model's tensors load in well under a minute
SETTING = "rollout.vllm_sync_timeout_s"


def nccl_version(v) -> str | None:
    """(2, 21, 5), 22105 or "2.21.5" -> "2.21.5" (None when unknown). Integer codes as NCCL_VERSION_CODE: major *
    10000 + minor * 100 + patch since NCCL 2.9, major * 1000 + minor * 100 + patch before."""
    if v is None or v == "" or v == ():
        return None
    if isinstance(v, (tuple, list)):
        return ".".join(str(int(x)) for x in v)
    if isinstance(v, int):
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"
    return str(v)


@dataclass
class SyncPlan:
    """How weights reach a server or a pool: kind "nccl" (world = 1 + workers; servers: each one's (url, workers),
    in the pool's order) or "file"; why: the reason for "file"."""

    kind: str
    workers: int = 0
    why: str = ""
    servers: list = field(default_factory=list)


def plan_weight_sync(health: dict, url: str, on_cuda: bool, local_gpu: str | None = None,
                     local_nccl: str | None = None) -> SyncPlan:
    """The path of this server's weight syncs, decided once per server:
        file   the tensors are not on CUDA, the server was started without --nccl, or one of its workers runs on
               this process's GPU (NCCL refuses two ranks of one group on one device, and a colocated server is
               what scripts/train_grounding.sh starts by default): the safetensors file in /dev/shm, one warning line
        nccl   otherwise, world = 1 + the server's workers (its /health "workers": one per GPU of vLLM's tensor,
               pipeline and data parallel ranks, counted by the server through `collective_rpc`)
    NCCL's init compares every rank's version (major, minor, patch) and fails on any difference, so another
    version is refused here before anything starts; an unknown one gets a warning and the bounded rendezvous.
    health: the /health answer; on_cuda: the tensors to send are on a GPU; local_gpu: that GPU's UUID; local_nccl:
    this process's NCCL version. Raises ServerError (one line): no worker count, or another NCCL version."""
    if not on_cuda:
        return SyncPlan("file", why="the weights are not on a GPU")
    if not health.get("nccl"):
        return SyncPlan("file", why="the server was started without --nccl")
    if "workers" not in health:
        raise ServerError(f"the vLLM server at {url} was started with --nccl but does not report its workers (an "
                          "older mmpg vllm-serve): restart it from this checkout (scripts/vllm_serve.sh)")
    workers = int(health["workers"])
    gpus = {_gpu_id(g) for g in health.get("worker_gpus") or [] if g}
    if local_gpu and _gpu_id(local_gpu) in gpus:
        return SyncPlan("file", workers, why=f"the vLLM server runs on this process's GPU ({local_gpu}) and NCCL "
                                             "refuses two ranks on one GPU: weights go by file")
    theirs, ours = nccl_version(health.get("nccl_version")), nccl_version(local_nccl)
    if theirs and ours and theirs != ours:
        raise ServerError(f"NCCL {ours} here and NCCL {theirs} in the vLLM server at {url}: NCCL joins only equal "
                          "versions; install one nvidia-nccl version in both environments (or point the server at "
                          "this one with VLLM_NCCL_SO_PATH), or restart the server without --nccl (weights by file)")
    if not theirs or not ours:
        log.warning("the NCCL version of %s is unknown (here %s, server %s): trying the NCCL weight sync anyway, for "
                    "at most rollout.vllm_sync_timeout_s", url, ours or "unknown", theirs or "unknown")
    return SyncPlan("nccl", workers, servers=[(url, workers)])


def plan_pool_sync(healths: dict[str, dict], on_cuda: bool, local_gpu: str | None = None,
                   local_nccl: str | None = None) -> SyncPlan:
    """The path of a pool's weight syncs (healths: each server's /health by URL, in the pool's order): NCCL when
    every server takes it (one group, `NCCLWeightSender`), the file when none does. A mixed pool (some servers on
    this process's GPU or started without --nccl) takes the file when every server runs on this machine (one
    warning line, from the caller), else it is refused in one line: a server elsewhere cannot read the file."""
    plans = {url: plan_weight_sync(h, url, on_cuda, local_gpu, local_nccl) for url, h in healths.items()}
    if len(plans) == 1:
        return next(iter(plans.values()))
    by_file = [url for url, p in plans.items() if p.kind == "file"]
    if not by_file:
        return SyncPlan("nccl", sum(p.workers for p in plans.values()),
                        servers=[s for p in plans.values() for s in p.servers])
    if len(by_file) == len(plans):
        return SyncPlan("file", why=plans[by_file[0]].why)
    why = f"{len(by_file)} of the pool's {len(plans)} servers take weights by file ({plans[by_file[0]].why})"
    here = socket.gethostname()
    elsewhere = [url for url, h in healths.items() if h.get("host") not in (None, here)]
    if elsewhere:
        raise ServerError(f"{why}, and {', '.join(elsewhere)} run(s) on another machine, which the file cannot "
                          "reach: start every server of the pool alike (all with --nccl on GPUs of their own, or "
                          "all on this machine without it)")
    return SyncPlan("file", why=f"{why}: the whole pool takes the file (one for all)")


def check_weight_path(health: dict, url: str) -> None:
    """Refuse, before the first step, a server on another machine that can only get weights by file: the file is
    written here (/dev/shm), where that server cannot read it. Its /health "host" is its machine's name (a server
    that does not say is not checked)."""
    theirs, ours = health.get("host"), socket.gethostname()
    if theirs and theirs != ours and not health.get("nccl"):
        raise ServerError(f"the vLLM server at {url} runs on {theirs}, this trainer on {ours}, and it was started "
                          "without --nccl: weights reach another machine only by NCCL (GPUs); restart it with --nccl "
                          "(VLLM_ARGS=--nccl), or run it on this machine")


def _gpu_id(uuid) -> str:
    """A GPU UUID as torch prints it, with or without nvidia-smi's "GPU-" prefix, in one form."""
    return str(uuid).strip().lower().removeprefix("gpu-")


def local_gpu_facts(device: torch.device) -> tuple[str | None, str | None]:
    """(UUID of this CUDA device, this process's NCCL version) for `plan_weight_sync`; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    try:
        version = nccl_version(torch.cuda.nccl.version())
    except (RuntimeError, AttributeError):
        version = None
    return (str(uuid) if uuid is not None else None), version


class _Side:
    """fn() on a daemon thread, waited for with a deadline and never joined (`_wait_all`)."""

    def __init__(self, name: str, fn):
        self.name, self.value, self.error, self.done = name, None, None, threading.Event()
        threading.Thread(target=self._run, args=(fn,), name=f"mmpg-nccl-{name}", daemon=True).start()

    def _run(self, fn):
        try:
            self.value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self.done.set()


def _wait_all(sides: list[_Side], timeout_s: float, url: str, what: str) -> list:
    """The sides' results once all are done. The first that fails ends the wait at once; the deadline ends it too:
    a ServerError of one line either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        failed = next((s for s in sides if s.done.is_set() and s.error is not None), None)
        if failed is not None:
            e = failed.error
            why = str(e) if isinstance(e, ServerError) else (f"{what} failed in {failed.name} ({type(e).__name__}: "
                                                             f"{e}) with the vLLM server at {url}")
            raise ServerError(f"{why}; NCCL weight sync: restart the server and the run, or restart the server "
                              "without --nccl (weights by file)")
        if all(s.done.is_set() for s in sides):
            return [s.value for s in sides]
        left = deadline - time.monotonic()
        if left <= 0:
            pending = ", ".join(s.name for s in sides if not s.done.is_set())
            raise ServerError(f"{what} with the vLLM server at {url} did not finish within {timeout_s:g} s "
                              f"({SETTING}; still waiting for {pending}): check the server's log, "
                              "restart it and the run, or restart it without --nccl (weights by file)")
        next(s for s in sides if not s.done.is_set()).done.wait(min(left, 0.05))


class NCCLWeightSender:
    """Rank 0 of one NCCL group with the workers of every server in `servers` ((url, workers) pairs, a pool's in
    order): server i's workers take ranks 1 + the workers of the servers before it, so one broadcast per tensor
    reaches them all. timeout_s: the most one set-up or one send may take (rollout.vllm_sync_timeout_s); device: the
    CUDA device of the tensors (default: the current one). After a failure every later send refuses at once (the
    group is unusable). UNTESTED on GPUs with several servers (`mmpg doctor`'s sync/nccl-pool row runs it)."""

    def __init__(self, servers, timeout_s: float = SYNC_TIMEOUT_S, device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the NCCL weight transfer needs a CUDA device; on the CPU the file sync is used")
        from torch.cuda import nccl

        self.servers = [(str(u), int(w)) for u, w in servers]
        self.url = ", ".join(u for u, _ in self.servers)  # what the messages name
        self.timeout_s, self.world = float(timeout_s), 1 + sum(w for _, w in self.servers)
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.broken: str | None = None
        uid = nccl.unique_id()
        sides, offset = [], 1
        for url, workers in self.servers:  # every server's workers enter the rendezvous with ours, at once
            payload = {"nccl_unique_id_b64": base64.b64encode(uid).decode(), "world_size": self.world,
                       "rank_offset": offset, "timeout_s": self.timeout_s}
            sides.append(_Side(f"{url}'s /init_weight_transfer", lambda url=url, payload=payload: call(
                url, "/init_weight_transfer", payload=payload, timeout=self.timeout_s,
                what="the NCCL weight transfer set-up", setting=SETTING)))
            offset += workers
        join = _Side("the NCCL rendezvous", lambda: self._join(uid))
        self.comm = self._wait([*sides, join], "the NCCL weight transfer set-up")[-1]

    def _join(self, uid: bytes):
        """ncclCommInitRank as rank 0 and vLLM's warm-up all_reduce (on a side thread: the device is per thread)."""
        from torch.cuda import nccl

        torch.cuda.set_device(self.device)
        comm = nccl.init_rank(self.world, uid, 0)
        warm = torch.zeros(1, device=self.device)
        nccl.all_reduce([warm], comms=[comm])
        torch.cuda.synchronize(self.device)
        return comm

    def send(self, named: dict[str, torch.Tensor], version: int) -> list[dict]:
        """Broadcast these CUDA tensors (HF names) to every server's workers, once each; returns the servers'
        answers in order (each names its weight version)."""
        if self.broken:
            raise ServerError(self.broken)
        t0 = time.perf_counter()
        names = list(named)
        meta = {"names": names, "dtype_names": [str(named[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(named[n].shape) for n in names], "version": version, "timeout_s": self.timeout_s}
        sides = [_Side(f"{url}'s /update_weights_nccl", lambda url=url: call(
            url, "/update_weights_nccl", payload=meta, timeout=self.timeout_s, what="an NCCL weight update",
            setting=SETTING)) for url, _ in self.servers]
        push = _Side(f"the broadcast of {len(names)} tensors", lambda: self._broadcast(named, names))
        answers = self._wait([*sides, push], "an NCCL weight update")[:-1]
        for out in answers:
            out["seconds_total"] = time.perf_counter() - t0
        return answers

    def _broadcast(self, named: dict[str, torch.Tensor], names: list[str]) -> None:
        from torch.cuda import nccl

        torch.cuda.set_device(self.device)
        stream = torch.cuda.current_stream(self.device)
        held = [named[n].contiguous() for n in names]  # alive until the stream is done with them
        for t in held:
            nccl.broadcast([t], root=0, streams=[stream], comms=[self.comm])
        torch.cuda.synchronize(self.device)

    def _wait(self, sides: list[_Side], what: str) -> list:
        try:
            return _wait_all(sides, self.timeout_s, self.url, what)
        except ServerError as e:
            self.broken = f"the NCCL weight sync with the vLLM server(s) at {self.url} is unusable after: {e}"
            raise
