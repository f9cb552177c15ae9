"""Multi-turn rollouts with the zoom tool through a vLLM server, against the HF engine on the trainer's policy
(tests/test_vllm_engine.py for Qwen2.5-VL, tests/test_vllm_qwen3.py for Qwen3-VL): each later turn is one request of
the whole conversation, its overview and its clips as the prompt's videos (wire 3), and vLLM's expansion of every
clip must be the trainer's prompt token for token (the engine checks each request)."""

from __future__ import annotations

import numpy as np
import torch
from batches import write_mp4
from test_zoom_rollout import _env

from mmpg.data.samples import GroundingSample
from mmpg.grouping import grouped_logprobs
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout.multiturn import sample_trajectories

TIE_TOL = 1e-3  # as tests/test_vllm_engine.py: a first difference within this logprob gap is a near-tie


def clip_source(folder) -> str:
    """A 20-second mp4 (100 frames at 5 fps) the scripted tool cuts its clips from."""
    return str(write_mp4(folder / "clips.mp4", [np.full((64, 96, 3), (k * 7) % 256, dtype=np.uint8)
                                                 for k in range(100)], fps=5))


def zoom_agreement(engine, model, processor, family: str, inputs, videos, source: str) -> dict:
    """Greedy trajectories (the scripted tool of tests/test_zoom_rollout.py: every stopped turn calls zoom, one
    call outside the video) of the B prompts, G = 2, through `engine` and through the HF engine: rows equal, or
    whose first difference is a near-tie of the trainer's logprobs; and the vLLM logprobs of its own rows' model
    tokens against the trainer's trajectory tree over them."""
    vocab = model.config.text_config.vocab_size
    sampling = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=tuple(range(0, vocab, 2)))
    b = int(inputs["input_ids"].shape[0])
    samples = [GroundingSample(f"v#{k}", source, 20.0, "q", (5.0, 6.0)) for k in range(b)]
    env = _env(family)
    ours = sample_trajectories(engine, model, processor, inputs, samples, 2, env, sampling, videos=videos)
    ref = sample_trajectories(HFEngine(model, processor), model, processor, inputs, samples, 2, env, sampling)
    with torch.no_grad():
        tree = grouped_logprobs(model, inputs, ours.completion_ids, ours.completion_mask, ours.group_sizes,
                                completion_visuals=ours.completion_visuals)
    equal, ties, bad = 0, [], []
    for i in range(ours.completion_ids.shape[0]):
        a = ours.completion_ids[i, :int(ours.completion_mask[i].sum())].tolist()
        r = ref.completion_ids[i, :int(ref.completion_mask[i].sum())].tolist()
        if a == r:
            equal += 1
            continue
        t = next(t for t in range(min(len(a), len(r)) + 1) if t == min(len(a), len(r)) or a[t] != r[t])
        own = t < min(len(a), len(r)) and bool(ours.own_mask[i, t]) and bool(ref.own_mask[i, t])
        gap = float(ref.logprobs[i, t] - tree[i, t]) if own else float("inf")  # the trainer's, both tokens
        (ties if gap <= TIE_TOL else bad).append((i, t, gap))
    diff = float(((tree - ours.logprobs).abs() * ours.own_mask).max())
    return {"equal": equal, "ties": ties, "bad": bad, "rows": len(ours.turns), "zooms": sum(ours.zooms),
            "errors": sum(t.error is not None for row in ours.tools for t in row), "logprob_diff": diff,
            "turns": max(len(t) for t in ours.turns)}
