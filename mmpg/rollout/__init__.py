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

from mmpg.rollout.engine import FINISH_LENGTH, FINISH_STOP, Rollout, RolloutEngine, SamplingParams
from mmpg.rollout.hf import HFEngine

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "HFEngine", "Rollout", "RolloutEngine", "SamplingParams"]
