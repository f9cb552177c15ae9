"""Run under `torchrun --nproc_per_node 2`: the vLLM weight sync's tensors gathered from a ZeRO-3 model (every
parameter partitioned over the 2 gloo ranks) against `sync_tensors` of the same model whole, before DeepSpeed.

    python -m torch.distributed.run --nproc_per_node 2 tests/zero3_sync_worker.py OUT.json

Cases: full fine-tuning (the vision tower frozen) and LoRA on q/v/up with random lora_B (so a sync that skipped the
merge, or merged with a partitioned, empty lora_B, would differ), each with `everything` off and on, each gathered
one tensor at a time (piece_bytes=1) and in default pieces. Rank 0 writes, per case: the names on both sides, the
tensors that differ (bitwise), the pieces gathered, and whether the model really was partitioned (every
parameter's local storage empty outside the gathers); rank 1 must come back with nothing kept.
"""

from __future__ import annotations

import copy
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from mmpg.config import LoraConfig  # noqa: E402
from mmpg.models.lora import apply_lora  # noqa: E402
from mmpg.models.lora_export import (  # noqa: E402
    PIECE_BYTES, gathered_sync_tensors, is_partitioned, sync_items, sync_pieces, sync_tensors)
from mmpg.toy.models import build_tiny_model  # noqa: E402

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}}


def policy(lora: bool):
    model = build_tiny_model("qwen2_5_vl", seed=0)
    model.model.visual.requires_grad_(False)
    if lora:
        model.requires_grad_(False)
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]), "tiny",
                   freeze_vision=True)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def case(lora: bool, rank: int) -> dict:
    import deepspeed

    model = policy(lora)
    with torch.no_grad():
        whole = {e: {n: t.clone() for n, t in sync_tensors(model, everything=e).items()} for e in (False, True)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-3),
                                           config=copy.deepcopy(ZERO3))
    model = engine.module
    out = {"partitioned": is_partitioned(model) and all(p.numel() == 0 for p in model.parameters())}
    for everything in (False, True):
        for piece_bytes in (1, PIECE_BYTES):
            got = gathered_sync_tensors(model, everything, keep=rank == 0, piece_bytes=piece_bytes)
            want = whole[everything]
            out[f"everything={everything},piece_bytes={piece_bytes}"] = {
                "names_got": sorted(got), "names_want": sorted(want),
                "differ": sorted(n for n in want if n in got and not (
                    got[n].dtype == want[n].dtype and got[n].shape == want[n].shape and torch.equal(got[n], want[n]))),
                "pieces": len(sync_pieces(sync_items(model, everything), piece_bytes)),
                "devices": sorted({str(t.device) for t in got.values()})}
    out["released"] = all(p.numel() == 0 for p in model.parameters())  # every gather gave its parameters back
    return out


def main(argv: list[str]) -> None:
    path = argv[0]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    results = {"lora" if lora else "full": case(lora, rank) for lora in (False, True)}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)
    else:  # nothing kept off rank 0
        assert all(not r["names_got"] for c in results.values() for k, r in c.items() if isinstance(r, dict)), \
            "a rank other than 0 kept tensors"
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
