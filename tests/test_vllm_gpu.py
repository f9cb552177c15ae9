"""The GPU vLLM path: the `vllm` package on CUDA, weights synced by vLLM's NCCL transfer (`mmpg.rollout.vllm_nccl`).
UNTESTED on a GPU so far. Markers gpu + vllm: `pytest -m "gpu and vllm" tests/test_vllm_gpu.py` on a machine with a
GPU and a CUDA vLLM environment (`mmpg doctor` runs it where there are two GPUs).
With two GPUs or more the server gets GPU 1 and the trainer GPU 0, and the weights go by NCCL; with one, the server
shares the trainer's GPU (colocated), where NCCL cannot go, and the weights go by file (the choice is recorded).
Checks: a bfloat16 server's greedy answers after the weight sync equal the trainer's own (or first differ at a
near-tie, the top-2 logprobs within BF16_TIE_TOL), and its logprobs agree with `grouped_logprobs` within BF16_ATOL."""

from __future__ import annotations

import pytest
import torch
from batches import vl_batch
from vllm_server import need_vllm

from mmpg import choices
from mmpg.rollout import HFEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

BF16_TIE_TOL = 0.05  # bfloat16 logits: near-ties flip easily
BF16_ATOL = 0.1  # |vLLM logprob - grouped_logprobs| in bfloat16 (different kernels: flash attention vs SDPA)


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    need_vllm()
    from mmpg.toy.models import TinySpec, make_tiny
    from mmpg.serve.launch import ServerProcess

    ckpt = make_tiny("qwen2_5_vl", tmp_path_factory.mktemp("vllm_gpu") / "q25", seed=0,
                     spec=TinySpec(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                                   vision_depth=2))
    log = tmp_path_factory.mktemp("vllm_gpu_log") / "server.log"
    own_gpu = torch.cuda.device_count() >= 2  # else colocated on GPU 0
    server = ServerProcess(ckpt, log, dtype="bfloat16", max_model_len=2048, eager=False,
                           extra=("--gpu-memory-utilization", "0.3", "--nccl"),
                           env={"CUDA_VISIBLE_DEVICES": "1"} if own_gpu else None)
    server.wait(600)
    yield ckpt, server.url
    server.stop()


def test_gpu_nccl_sync_then_greedy_matches_trainer(gpu_server):
    from test_vllm_engine import VIDEOS, _videos
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpg.grouping import grouped_logprobs
    from mmpg.rollout.vllm import VLLMEngine

    ckpt, url = gpu_server
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).cuda()
    processor = AutoProcessor.from_pretrained(ckpt)
    for name, p in model.named_parameters():
        p.requires_grad_("visual" not in name)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.add_(torch.randn_like(p) * 0.05)
    engine = VLLMEngine(model, processor, url=url)
    sent = engine.sync_weights()  # NCCL on a GPU of the server's own (started with --nccl), else by file
    assert sent["tensors"] == sum(1 for p in model.parameters() if p.requires_grad)
    assert choices.current()["weight_sync"]["value"] == ("nccl" if torch.cuda.device_count() >= 2 else "file")
    inputs, videos = vl_batch(processor, "qwen2_5_vl", VIDEOS), _videos(VIDEOS)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
    got = engine.generate_groups(inputs, 2, greedy, videos=videos)
    ref = HFEngine(model, processor).generate_groups(inputs.to("cuda"), 2, greedy)
    with torch.no_grad():
        lp = grouped_logprobs(model, inputs.to("cuda"), got.completion_ids.cuda(), got.completion_mask.cuda(),
                              got.group_sizes).cpu()
    for i in range(len(ref.texts)):
        a, b = ref.completion_ids[i].tolist(), got.completion_ids[i].tolist()
        if a != b:
            t = next(t for t, (x, y) in enumerate(zip(a, b)) if x != y)
            assert float(ref.logprobs[i, t] - lp[i, t]) <= BF16_TIE_TOL, f"row {i} differs at token {t}"
    assert float(((lp - got.logprobs).abs() * got.completion_mask).max()) <= BF16_ATOL
