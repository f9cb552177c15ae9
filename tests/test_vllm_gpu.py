"""The GPU vLLM path: the `vllm` package on CUDA, weights synced by vLLM's NCCL transfer (`mmpg.rollout.vllm_nccl`).
UNTESTED on a GPU so far. Markers gpu + vllm: `pytest -m "gpu and vllm" tests/test_vllm_gpu.py` on a machine with a
GPU and a CUDA vLLM environment (`mmpg doctor` runs it where there are two GPUs).
With two GPUs or more the server gets GPU 1 and the trainer GPU 0, and the weights go by NCCL; with one, the server
shares the trainer's GPU (colocated), where NCCL cannot go, and the weights go by file (the choice is recorded).
With three or more, a pool of two servers (GPUs 1 and 2) gets the weights by one NCCL group (`-k pool`; the
`sync/nccl-pool` row of `mmpg doctor`), and each server's greedy answers must equal the trainer's.
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


def _checkpoint(tmp_path_factory):
    from mmpg.toy.models import TinySpec, make_tiny

    return make_tiny("qwen2_5_vl", tmp_path_factory.mktemp("vllm_gpu") / "q25", seed=0,
                     spec=TinySpec(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                                   vision_depth=2))


def _start(ckpt, log, gpu: str | None):
    from mmpg.serve.launch import ServerProcess

    return ServerProcess(ckpt, log, dtype="bfloat16", max_model_len=2048, eager=False,
                         extra=("--gpu-memory-utilization", "0.3", "--nccl"),
                         env={"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None)


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    need_vllm()
    ckpt = _checkpoint(tmp_path_factory)
    own_gpu = torch.cuda.device_count() >= 2  # else colocated on GPU 0
    server = _start(ckpt, tmp_path_factory.mktemp("vllm_gpu_log") / "server.log", "1" if own_gpu else None)
    server.wait(600)
    yield ckpt, server.url
    server.stop()


def _perturbed_policy(ckpt):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).cuda()
    for name, p in model.named_parameters():
        p.requires_grad_("visual" not in name)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.add_(torch.randn_like(p) * 0.05)
    return model, AutoProcessor.from_pretrained(ckpt)


def test_gpu_nccl_sync_then_greedy_matches_trainer(gpu_server):
    from mmpg.rollout.vllm import VLLMEngine

    ckpt, url = gpu_server
    model, processor = _perturbed_policy(ckpt)
    engine = VLLMEngine(model, processor, url=url)
    sent = engine.sync_weights()  # NCCL on a GPU of the server's own (started with --nccl), else by file
    assert sent["tensors"] == sum(1 for p in model.parameters() if p.requires_grad)
    assert choices.current()["weight_sync"]["value"] == ("nccl" if torch.cuda.device_count() >= 2 else "file")
    _greedy_matches_trainer(engine, model, processor)


def test_gpu_nccl_sync_to_a_pool_then_each_server_greedy_matches_trainer(tmp_path_factory):
    """Two --nccl servers on GPUs 1 and 2, the trainer on GPU 0: one NCCL group of 1 + 2 ranks, every tensor
    broadcast once; then each server, asked alone, answers as the trainer does."""
    if torch.cuda.device_count() < 3:
        pytest.skip(f"a pool synced by NCCL needs three GPUs (the trainer's and two servers'); "
                    f"{torch.cuda.device_count()} here")
    need_vllm()
    from mmpg.rollout.vllm import VLLMEngine

    ckpt = _checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("vllm_gpu_pool")
    servers = [_start(ckpt, logs / f"server{g}.log", str(g)) for g in (1, 2)]
    try:
        for server in servers:
            server.wait(600)
        model, processor = _perturbed_policy(ckpt)
        engine = VLLMEngine(model, processor, url=",".join(s.url for s in servers))
        sent = engine.sync_weights()
        assert sent["tensors"] == sum(1 for p in model.parameters() if p.requires_grad)
        assert choices.current()["weight_sync"]["value"] == "nccl"
        for server in servers:
            alone = VLLMEngine(model, processor, url=server.url)
            assert alone.version == engine.version == 1
            _greedy_matches_trainer(alone, model, processor)
    finally:
        for server in servers:
            server.stop()


def _greedy_matches_trainer(engine, model, processor):
    from test_vllm_engine import VIDEOS, _videos

    from mmpg.grouping import grouped_logprobs

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
