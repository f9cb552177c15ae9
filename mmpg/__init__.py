"""mmpg: shared-prefix GRPO for video temporal grounding with Qwen-VL models.

Each prompt (video + question) is forwarded once with its G sampled responses packed behind it; see
docs/ARCHITECTURE.md for the design and `mmpg.grouping` for the exact grouped forward.
"""

__version__ = "0.1.0"
