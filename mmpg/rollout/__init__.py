"""Shared-prefix rollouts: each prompt (and its video) is prefilled once and its G responses share that cache.

    from mmpg.rollout import HFEngine, SamplingParams
    rollout = HFEngine(model, processor).generate_groups(prompt_inputs, group_size=8,
                                                         sampling=SamplingParams(max_new_tokens=256, temperature=1.0))
    logps = grouped_logprobs(model, prompt_inputs, rollout.completion_ids, rollout.completion_mask,
                             rollout.group_sizes, temperature=1.0)  # == rollout.logprobs up to float rounding

`RolloutEngine` is the interface; `HFEngine` samples with the training model itself, `mmpg.rollout.vllm.VLLMEngine`
(imported only where used) with a vLLM server, and `mmpg.rollout.build.make_rollout_engine` builds the one a config
names.
By default (`decode="cascade"`, config `rollout.decode`) it keeps each prompt's K/V once and reads it once per step
for all G rows (`mmpg.rollout.cascade`), and prefills a video asked by several adjacent queries once
(`mmpg.rollout.shares`); `decode="copy"` copies each prompt's prefill G ways (the A/B reference).
"""

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "HFEngine", "Rollout", "RolloutEngine", "SamplingParams"]
_HOME = {"HFEngine": "mmpg.rollout.hf", **{name: "mmpg.rollout.engine" for name in __all__ if name != "HFEngine"}}


def __getattr__(name: str):
    """The engines imported on first use (torch and transformers with them), so a command that only reads a config
    (`mmpg train --get`, `mmpg vllm-len`'s parser) does not pay for them."""
    if name not in _HOME:
        raise AttributeError(f"module 'mmpg.rollout' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOME[name]), name)
