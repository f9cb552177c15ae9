"""Eval-level variants: greedy answers to Q queries of one video (one answer of exactly S tokens each, no gradient),
as `mmpg eval` decodes a batch holding a video's queries side by side (`eval.share_videos`).

    hf_generate  `model.generate` on the Q prompts (one return sequence each): each prompt, its video included, is
                 prefilled on its own row
    mmpg         `HFEngine.generate_groups(group_size=1)` with sharing off (`share_videos = False`): each query's
                 prompt prefilled once, the video encoded once per query: `mmpg eval` before the tree, the baseline
    tree         the same engine with sharing on: the video's shared part prefilled (and encoded) once for its Q
                 queries, each query's tail prefilled against it, the decode reading the shared K/V once per step

Ceiling (`rho_eval`, `mmpg.bench.flops.eval_flops_q`): per-query FLOPs over the layout's; the decode is the same in
all, so the gain is the prefill's and shrinks as S grows. Prompts: `mmpg.bench.batch.make_query_batch` (P shared
tokens, tails of t). Each step records its phases (prefill_s until the first token's logits, decode_s) and the
engine's `last_stats` (prefixes prefilled, prefix tokens) in info["phases"].
"""

from __future__ import annotations

import time

import torch

from mmpg.bench.memory import sync


def setup(case: dict, device: torch.device):
    """(None, step, info): the model and the Q prompts built here; `step()` answers them once."""
    from mmpg.bench.batch import make_query_batch
    from mmpg.bench.rollout import time_prefill
    from mmpg.bench.model import build_model
    from mmpg.bench.flops import layout_tokens
    from mmpg.rollout import HFEngine, SamplingParams

    variant, S, Q = case["variant"], case["S"], case.get("Q", 1)
    model, ids = build_model(case, device)
    model.eval()
    prompt, info = make_query_batch(model, dict(case, Q=Q, t=case.get("t", 32)), ids, device)
    info["phases"] = []
    layout = {"hf_generate": "per_query", "mmpg": "per_query", "tree": "tree"}[variant]
    info["tokens"] = int(layout_tokens(layout, info["P"], case.get("t", 32), 0, 1, Q))  # prompt tokens prefilled
    if variant == "hf_generate":
        def generate():
            with torch.no_grad():
                model.generate(**prompt, do_sample=False, max_new_tokens=S, min_new_tokens=S, pad_token_id=0)
            return None, None
    else:
        # cascade: the path that shares; per query with sharing off
        engine = HFEngine(model, ids["tokenizer"], decode="cascade", share_videos=variant == "tree")
        sampling = SamplingParams(max_new_tokens=S, temperature=0.0, stop_token_ids=(), logprobs=False)
        marks = time_prefill(engine, device)

        def generate():
            engine.generate_groups(prompt, 1, sampling)
            return marks[-1] if marks else None, dict(engine.last_stats)

    def step():
        sync(device)
        t0 = time.perf_counter()
        first, stats = generate()
        sync(device)
        t1 = time.perf_counter()
        phase = {"prefill_s": first - t0 if first else None, "decode_s": t1 - first if first else None}
        info["phases"].append(dict(phase, **(stats or {})))

    return None, step, info
