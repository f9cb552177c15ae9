"""The exact shared-prefix grouped forward, usable on its own by any trainer.

    from mmpg.grouping import grouped_logprobs, repeated_logprobs
    logps = grouped_logprobs(model, prompt_inputs, completion_ids, completion_mask, group_sizes)  # [N, S] float32
    out = grouped_forward(...)  # the same logprobs (out.logprobs) and what the forward packed (`GroupedLogprobs`)

Math (Prefix Grouper, arXiv 2506.05433): self-attention of response token j of group b is
softmax over {prefix_b} ∪ {own earlier response tokens}; splitting the key set into the shared prefix and the own
response and combining by log-sum-exp gives the same value as attending over [prefix_b | response] alone, so one
forward of [prefix_b | r_b1 | ... | r_bG] with that rule equals G separate forwards. The prefix sees only itself, so
its hidden states (and the vision tower's output) are computed once. Where we depart from the paper: we pack several
groups in one padding-free row, take positions from the model's own 3-D mRoPE index, and run the LM head only on
positions that predict response tokens. Adjacent prompts that begin alike (a video's several questions) share that
leading part too, each row carrying its query's tail before its response (`mmpg.grouping.shares`).
"""

from mmpg.grouping.layout import GroupLayout
from mmpg.grouping.logprobs import GroupedLogprobs, grouped_forward, grouped_logprobs, head_logprobs, repeated_logprobs
from mmpg.grouping.patch import (
    SUPPORTED_MODEL_TYPES, GroupingState, apply_grouped_attention, grouping_state, set_grouping_options,
)

__all__ = [
    "GroupLayout", "GroupedLogprobs", "GroupingState", "SUPPORTED_MODEL_TYPES", "apply_grouped_attention",
    "grouped_forward", "grouped_logprobs", "grouping_state", "head_logprobs", "repeated_logprobs",
    "set_grouping_options",
]
