"""Rollout-level variants: sampling G responses of S tokens for one prompt of P tokens (no gradient).

    hf_generate  `model.generate(num_return_sequences=G)`: the prompt (and its video) is expanded G times and
                 prefilled G times
    mmpg         `mmpg.rollout.HFEngine.generate_groups`: the prompt is prefilled once and its cache copied G ways

Both decode exactly S tokens (no stop token), so only the prefill differs: its FLOPs ratio is about G, the whole
rollout's about ρ_lin when decode is cheap. `mmpg.rollout` is imported lazily: when it is missing or broken the
row says "not available" and the other levels still run.
"""

from __future__ import annotations

import torch

VARIANTS = ("hf_generate", "mmpg")


def setup(case: dict, device: torch.device):
    """(None, step, info): model and prompt built here; `step()` samples the G responses."""
    from mmpg.bench.model import build_model, make_inputs

    variant = case["variant"]
    if variant not in VARIANTS:
        raise ValueError(f"unknown rollout variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    if variant == "mmpg":
        try:
            from mmpg.rollout import HFEngine, SamplingParams
        except Exception as err:  # noqa: BLE001 - any import failure means the engine is not usable here
            raise NotImplementedError(f"mmpg.rollout not available ({type(err).__name__}: {err})") from None
    model, ids = build_model(case, device)
    model.eval()
    prompt, _, _, info = make_inputs(model, case, ids, device)
    G, S = case["G"], case["S"]

    if variant == "mmpg":
        engine = HFEngine(model, ids["tokenizer"])
        sampling = SamplingParams(max_new_tokens=S, temperature=1.0, stop_token_ids=(), logprobs=False)

        def step():
            engine.generate_groups(prompt, G, sampling)
    else:
        def step():
            with torch.no_grad():
                model.generate(**prompt, num_return_sequences=G, do_sample=True, max_new_tokens=S,
                               min_new_tokens=S, pad_token_id=0)

    info["tokens"] = info["P"] + G * S if variant == "mmpg" else G * (info["P"] + S)
    return None, step, info
