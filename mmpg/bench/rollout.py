"""Rollout-level variants: sampling G responses of S tokens for each of B prompts of P tokens (no gradient).

    hf_generate    `model.generate(num_return_sequences=G)`: the prompt (and its video) is expanded G times and
                   prefilled G times; every decode step reads the G copies of the prompt's K/V
    mmpg:copy      `HFEngine(decode="copy").generate_groups`: the prompt is prefilled once and its cache copied G ways
    mmpg:cascade   `HFEngine(decode="cascade")`: prefilled once, its K/V held once; each decode step reads it once for
                   the G rows and merges with the rows' own K/V by log-sum-exp (`mmpg.rollout.cascade`)
    mmpg           the engine's default decode mode (cascade)
    mmpg:cascade_flash, mmpg:cascade_sdpa, mmpg:cascade_math   cascade with that kernel (`mmpg.rollout.
                   cascade_kernels`; "cascade" takes the engine's auto choice: sdpa on CPU, math elsewhere)
    vllm           `VLLMEngine.generate_groups` against a `mmpg vllm-serve` (opt-in, `mmpg.bench.rollout_vllm`)

B (config key, default 1): the prompts of one step, equal in shape, seeds 1..B (`mmpg.bench.batch.make_batch`).

All decode exactly S tokens (no stop token). Besides the total time, each step records its phases, kept in the
worker's `info`, aggregated by `mmpg.bench.runner.run_config`, printed by `mmpg.bench.tables.rollout_table`:

    prefill_s  the prompt forward up to the first token's logits (generate: until its streamer receives token 0)
    decode_s   the rest: sampling and the S - 1 decode forwards
    kv_MB      the K/V the cache holds after the last decode step (copy: B·G·(P + S - 1) tokens, cascade:
               B·(P + G·S) as its own buffers are preallocated), to compare with ρ_lin = G(P+S)/(P+G·S)

CUDA is synchronised around each phase. `mmpg.rollout` is imported lazily: when it is missing or broken the row
says "not available" and the other variants still run, as they do beside a vllm row that says why it cannot run.
"""

from __future__ import annotations

import time

import torch

from mmpg.bench.batch import forward_tokens, make_batch
from mmpg.bench.memory import sync
from mmpg.grouping.inputs import pad_token_id

# the variant's backend slot -> (HFEngine decode mode, cascade kernel backend)
DECODE = {None: ("cascade", "auto"), "copy": ("copy", "auto"), "cascade": ("cascade", "auto"),
          "cascade_flash": ("cascade", "flash"), "cascade_sdpa": ("cascade", "sdpa"),
          "cascade_math": ("cascade", "math")}


def _cache_bytes(cache) -> int | None:
    if cache is None:
        return None
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


class _FirstToken:
    """A `generate` streamer that notes when the first new token arrives (its first `put` is the prompt)."""

    def __init__(self, device):
        self.device, self.calls, self.at = device, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            sync(self.device)
            self.at = time.perf_counter()

    def end(self):
        pass


def time_prefill(engine, device) -> list[float]:
    """Hook this engine instance's prefill (the engine itself never syncs): after each prefill, CUDA synced, the
    time is appended to the returned list (when the first token's logits were ready)."""
    prefill, marks = engine._prefill, []

    def timed_prefill(*args, **kwargs):
        out = prefill(*args, **kwargs)
        sync(device)
        marks.append(time.perf_counter())
        return out

    engine._prefill = timed_prefill
    return marks


def setup(case: dict, device: torch.device):
    """(None, step, info): model and prompts built here; `step()` samples the B·G responses and appends its phases
    {"prefill_s", "decode_s", "kv_bytes"} to info["phases"]."""
    from mmpg.bench.model import build_model

    variant = case["variant"]
    if variant == "vllm":
        from mmpg.bench import rollout_vllm

        return rollout_vllm.setup(case, device)
    if variant == "mmpg":
        if case.get("backend") not in DECODE:
            raise ValueError(f"unknown mmpg rollout decode mode {case.get('backend')!r}; choose one of "
                             f"{', '.join(k for k in DECODE if k)}")
        try:
            from mmpg.rollout import HFEngine, SamplingParams
        except Exception as err:  # noqa: BLE001 - any import failure means the engine is not usable here
            raise NotImplementedError(f"mmpg.rollout not available ({type(err).__name__}: {err})") from None
    model, ids = build_model(case, device)
    model.eval()
    prompt, info = make_batch(model, case, ids, device)
    G, S, B = case["G"], case["S"], prompt["input_ids"].shape[0]
    info["phases"] = []

    if variant == "mmpg":
        decode, backend = DECODE[case.get("backend")]
        # the named kernel, unchecked: a check that stepped down would time another path under this label
        engine = HFEngine(model, ids["tokenizer"], decode=decode, cascade_backend=backend, decode_check="off")
        sampling = SamplingParams(max_new_tokens=S, temperature=1.0, stop_token_ids=(), logprobs=False)
        marks = time_prefill(engine, device)

        def generate():  # -> (when the first token's logits were ready, the K/V bytes after the last step)
            engine.generate_groups(prompt, G, sampling)
            return marks[-1], lambda: engine.last_kv_bytes
    else:
        def generate():
            streamer = _FirstToken(device)
            with torch.no_grad():
                out = model.generate(**prompt, num_return_sequences=G, do_sample=True, max_new_tokens=S,
                                     min_new_tokens=S, pad_token_id=pad_token_id(model), streamer=streamer,
                                     return_dict_in_generate=True)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            return streamer.at, lambda: _cache_bytes(cache)

    def step():
        sync(device)
        t0 = time.perf_counter()
        first, kv_bytes = generate()
        sync(device)
        t1 = time.perf_counter()
        info["phases"].append({"prefill_s": first - t0, "decode_s": t1 - first, "kv_bytes": kv_bytes()})

    info["tokens"] = B * forward_tokens(info["P"], S, G, shared=variant == "mmpg")
    return None, step, info
