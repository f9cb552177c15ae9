"""GPU weight sync to the vLLM server over NCCL, without importing vllm here. UNTESTED: it has not run on a GPU yet;
`tests/test_vllm_gpu.py` (markers gpu, vllm) and `MMPG_GPU_VLLM=1 bash scripts/gpu_check.sh` check it.

vLLM's RL weight transfer (`init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
`finish_weight_update`, NCCL backend) lets a trainer that cannot import vLLM join by NCCL unique id:

    trainer (rank 0)                                     server workers (ranks 1..W)
    uid = torch.cuda.nccl.unique_id()
    POST /init_weight_transfer {uid (base64), world} ->  ncclCommInitRank(uid, rank)   (concurrently with ours)
    init_rank(world, uid, 0); one-element all_reduce     their warm-up all_reduce (the handshake vLLM requires)
    POST /update_weights_nccl {names, dtypes, shapes} -> start, receive one broadcast per tensor, load_weights, finish
    broadcast(tensor, root 0) for each, in that order

The HTTP calls block until the workers are done, so they run on a side thread while this thread does the NCCL part.
The file path of `VLLMEngine.sync_weights` works on GPUs too (same host); this one skips the host copy.
"""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from mmpg.serve.wire import call


class NCCLWeightSender:
    """Rank 0 of a NCCL group with the server's workers. url: the server; workers: its tensor-parallel size."""

    def __init__(self, url: str, workers: int = 1, timeout_s: float = 600.0):
        if not torch.cuda.is_available():
            raise RuntimeError("the NCCL weight transfer needs a CUDA device; on the CPU the file sync is used")
        from torch.cuda import nccl

        self.url, self.timeout_s, self.world = url, timeout_s, 1 + int(workers)
        uid = nccl.unique_id()
        payload = {"nccl_unique_id_b64": base64.b64encode(uid).decode(), "world_size": self.world}
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(call, url, "/init_weight_transfer", payload=payload, timeout=timeout_s,
                                 what="the NCCL weight transfer set-up")
            self.comm = nccl.init_rank(self.world, uid, 0)
            warm = torch.zeros(1, device="cuda")
            nccl.all_reduce([warm], comms=[self.comm])  # vLLM's handshake: one all_reduce before anything else
            answer.result()

    def send(self, named: dict[str, torch.Tensor], version: int) -> dict:
        """Broadcast these CUDA tensors (HF names) to the workers; returns the server's answer (its weight version)."""
        from torch.cuda import nccl

        t0 = time.perf_counter()
        names = list(named)
        meta = {"names": names, "dtype_names": [str(named[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(named[n].shape) for n in names], "version": version}
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(call, self.url, "/update_weights_nccl", payload=meta, timeout=self.timeout_s,
                                 what="an NCCL weight update")
            stream = torch.cuda.current_stream()
            for n in names:
                nccl.broadcast([named[n].contiguous()], root=0, streams=[stream], comms=[self.comm])
            torch.cuda.synchronize()
            out = answer.result()
        out["seconds_total"] = time.perf_counter() - t0
        return out
