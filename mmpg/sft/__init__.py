"""`mmpg sft`: the supervised warm start on grounding annotations, on the same training base as `mmpg train`."""
