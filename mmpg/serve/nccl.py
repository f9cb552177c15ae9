"""The server's side of the NCCL weight sync (`mmpg.rollout.vllm_nccl` is the trainer's) and the worker facts the
trainer decides it by. UNTESTED on a GPU; the routes and their answers are tested on the CPU with a stand-in engine.

/health reports what the trainer needs before it joins a NCCL group with the workers (`worker_facts`), counted by
the server itself: `collective_rpc` reaches every worker (vLLM's tensor, pipeline and data parallel ranks) once, so
"workers" is the number of NCCL ranks the workers take; "worker_gpus", their devices' UUIDs (a trainer on one of
them is colocated: NCCL refuses two ranks on one GPU); "nccl_version", the NCCL library vLLM's weight transfer
loads (vLLM's own pynccl loader, which honours VLLM_NCCL_SO_PATH; else torch's).

Bounded: the trainer sends its deadline (`timeout_s`) with each NCCL request and the server waits for its workers no
longer (`collective_rpc(timeout=)`): a trainer that never joins costs one error answer, not a server stuck in the
request. Workers left inside NCCL's rendezvous cannot be cancelled: the answer says to restart the server.
"""

from __future__ import annotations

DEFAULT_TIMEOUT_S = 300.0


def worker_info() -> dict:
    """On one vLLM worker: {"device", "gpu" (UUID or None), "nccl" (version or None)}."""
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu", "gpu": None, "nccl": None}
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return {"device": f"cuda:{index}", "gpu": str(uuid) if uuid is not None else None, "nccl": _nccl_version()}


def _nccl_version() -> str | None:
    try:  # the library vLLM's weight transfer loads (VLLM_NCCL_SO_PATH, else the one torch ships)
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        return NCCLLibrary().ncclGetVersion()
    except Exception:  # noqa: BLE001 - no loadable NCCL there: say what torch was built with
        import torch

        try:
            return ".".join(str(x) for x in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            return None


def worker_facts(infos: list[dict]) -> dict:
    """Every worker's `worker_info` -> the /health fields {"workers", "worker_gpus", "nccl_version"}."""
    versions = sorted({i.get("nccl") for i in infos if i.get("nccl")})
    return {"workers": len(infos), "worker_gpus": [i.get("gpu") for i in infos],
            "nccl_version": versions[0] if len(versions) == 1 else (",".join(versions) or None)}


def init_weight_transfer(backend, payload: dict) -> dict:
    """Join the trainer's NCCL group (unique-id rendezvous; workers at ranks 1..) within the trainer's deadline."""
    if not backend.nccl:
        raise ValueError("this server was started without --nccl: restart it with --nccl, or let the trainer sync "
                         "weights by file")
    # a pool's servers share one group: this server's workers follow the trainer (rank 0) and the servers before it
    info = {"nccl_unique_id_b64": payload["nccl_unique_id_b64"], "rank_offset": int(payload.get("rank_offset", 1)),
            "world_size": int(payload["world_size"]), "packed": False}
    backend.loop.call(lambda llm: _rpc(llm, "init_weight_transfer_engine", payload, args=(info,)))
    return {"ok": True}


def update_weights_nccl(backend, payload: dict) -> dict:
    """Receive tensors broadcast one by one by the trainer (names, dtype names, shapes given) within its deadline."""
    import time

    t0 = time.perf_counter()
    info = {k: payload[k] for k in ("names", "dtype_names", "shapes")}
    def receive(llm):  # between requests, as the file sync (`EngineLoop.call`)
        _rpc(llm, "start_weight_update", payload)
        _rpc(llm, "update_weights", payload, args=(info,))
        _rpc(llm, "finish_weight_update", payload)
        backend.forget_caches(llm)
        backend.version = int(payload.get("version", backend.version + 1))

    backend.loop.call(receive)
    return {"version": backend.version, "tensors": len(info["names"]), "seconds": time.perf_counter() - t0}


def _rpc(llm, method: str, payload: dict, args: tuple = ()):
    timeout = float(payload.get("timeout_s") or DEFAULT_TIMEOUT_S)
    try:
        return llm.collective_rpc(method, timeout=timeout, args=args)
    except TimeoutError:
        raise RuntimeError(f"the workers' {method} did not finish within {timeout:g} s (the trainer never joined "
                           "or stopped sending): restart this server") from None
