"""Prompts a vLLM server cannot hold, left out of a rollout batch as counted skips.

vLLM refuses a request whose prompt + max_tokens exceeds its max_model_len. The launch script sizes the server for
the config's longest prompt and the trainer checks it before the first step (`mmpg.rollout.lengths`), so such a
prompt is rare: a query longer than the planned QUERY_TOKENS, a video longer than planned. It is left out like an
unreadable video (in `GroundingBatch.skipped`), so the ranks deal the rest of the global batch as they do around
unreadable videos and stay in lockstep, and the step reports it as data/too_long.
"""

from __future__ import annotations

import dataclasses

from mmpg.data.samples import Skip
from mmpg.rl.split import sub_batch


def drop_too_long(batch, limit: int, max_new_tokens: int, model, pad_id: int) -> tuple[object, list[Skip]]:
    """(the GroundingBatch without its prompts of more than limit - max_new_tokens tokens, a Skip for each one left
    out). The kept prompts' inputs are re-padded on the left; a batch left with none has no inputs (B = 0)."""
    lengths = batch.inputs["attention_mask"].sum(dim=1).tolist() if len(batch) else []  # [B] prompt tokens
    long = [b for b, n in enumerate(lengths) if n + max_new_tokens > limit]
    if not long:
        return batch, []
    skips = [Skip(batch.samples[b].where, f"its prompt has {int(lengths[b])} tokens; with rollout.max_new_tokens "
                  f"{max_new_tokens} that exceeds the vLLM server's max_model_len {limit} (a video or query longer "
                  "than the config planned for: mmpg vllm-len)") for b in long]
    keep = [b for b in range(len(batch)) if b not in long]
    kept = sub_batch(model, batch, keep, pad_id) if keep else dataclasses.replace(batch, samples=[], videos=[],
                                                                                   inputs=None)
    return dataclasses.replace(kept, skipped=list(batch.skipped) + skips), skips
