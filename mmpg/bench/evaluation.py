"""Eval-level variants: greedy answers to Q queries of each of B videos (one answer of exactly S tokens each, no
gradient), as `mmpg eval` decodes a batch holding a video's queries side by side (`eval.share_videos`) and
`eval.batch_size` prompts per batch.

    hf_generate  `model.generate` on the B·Q prompts (one return sequence each): each prompt, its video included, is
                 prefilled on its own row
    mmpg         `HFEngine.generate_groups(group_size=1)` with sharing off (`share_videos = False`): each query's
                 prompt prefilled once, the video encoded once per query: `mmpg eval` before video sharing, the
                 baseline
    tree         the same engine with sharing on: each video's shared part prefilled (and encoded) once for its Q
                 queries, each query's tail prefilled against it, the decode reading the shared K/V once per step

Ceiling (`rho_eval`, `mmpg.bench.flops.eval_flops_q`): per-query FLOPs over the layout's; the decode is the same in
all, so the gain is the prefill's and shrinks as S grows. Prompts: `mmpg.bench.batch.make_query_batch` (P shared
tokens, tails of t), video b drawn with seed 1 + b; B (`case["B"]`, default 1; `mmpg bench --videos-per-batch`)
times the engine's batching of several videos against one at a time. Each step records its phases (prefill_s until
the first token's logits, decode_s) and the engine's `last_stats` (prefixes prefilled, prefix tokens) in
info["phases"], and its answers (token ids [B·Q, S]) in info["answers"]: the runner counts the answers identical to
`hf_generate`'s (`same_answers`; float32 answers agree, in bfloat16 padding and sharing change the rounding and a
random-weight model's greedy answer follows it).
"""

from __future__ import annotations

import time

import torch

from mmpg.bench.memory import sync
from mmpg.grouping.inputs import pad_token_id


def query_batches(model, case: dict, ids: dict, device) -> tuple[dict, dict]:
    """B = case["B"] videos' Q queries each (`make_query_batch`, video b from seed 1 + b) as one batch: input_ids
    [B·Q, P + t], the videos' patches and grids concatenated in prompt order. Returns (prompt_inputs, info of the
    first video's shared part)."""
    from mmpg.bench.batch import make_query_batch

    parts = [make_query_batch(model, case, ids, device, seed=1 + b) for b in range(case.get("B", 1))]
    return {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}, parts[0][1]


def setup(case: dict, device: torch.device):
    """(None, step, info): the model and the B·Q prompts built here; `step()` answers them once."""
    from mmpg.bench.flops import layout_tokens
    from mmpg.bench.model import build_model
    from mmpg.bench.rollout import time_prefill
    from mmpg.rollout import HFEngine, SamplingParams

    variant, S, Q, B = case["variant"], case["S"], case.get("Q", 1), case.get("B", 1)
    model, ids = build_model(case, device)
    model.eval()
    prompt, info = query_batches(model, dict(case, Q=Q, t=case.get("t", 32)), ids, device)
    info["phases"] = []
    layout = {"hf_generate": "per_query", "mmpg": "per_query", "tree": "tree"}[variant]
    info["tokens"] = B * int(layout_tokens(layout, info["P"], case.get("t", 32), 0, 1, Q))  # prompt tokens prefilled
    if variant == "hf_generate":
        def generate():
            with torch.no_grad():
                out = model.generate(**prompt, do_sample=False, max_new_tokens=S, min_new_tokens=S,
                                     pad_token_id=pad_token_id(model))
            return None, None, out[:, -S:]
    else:
        # cascade: the path that shares; per query with sharing off
        engine = HFEngine(model, ids["tokenizer"], decode="cascade", share_videos=variant == "tree")
        sampling = SamplingParams(max_new_tokens=S, temperature=0.0, stop_token_ids=(), logprobs=False)
        marks = time_prefill(engine, device)

        def generate():
            out = engine.generate_groups(prompt, 1, sampling)
            return marks[-1] if marks else None, dict(engine.last_stats), out.completion_ids

    def step():
        sync(device)
        t0 = time.perf_counter()
        first, stats, answers = generate()
        sync(device)
        t1 = time.perf_counter()
        phase = {"prefill_s": first - t0 if first else None, "decode_s": t1 - first if first else None}
        info["phases"].append(dict(phase, **(stats or {})))
        info["answers"] = answers.tolist()  # [B·Q, S], the last step's

    return None, step, info
