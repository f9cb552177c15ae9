"""The config tree of `mmpg train` / `mmpg sft` and its checks, one package:

    tree.py       the dataclasses (every field with its help text), loading (defaults <- YAML <- overrides), describe
    checks.py     the value checks run after the merge: string choices and ranges
    reference.py  docs/config.md generated from the tree (`python -m mmpg.config.reference > docs/config.md`)

`from mmpg.config import Config, load_config` is the way in; the names below are what callers use.
"""

from mmpg.config.checks import CHOICES, validate
from mmpg.config.tree import (
    GROUPS, AlgorithmConfig, CheckpointConfig, Config, DataConfig, DeepSpeedConfig, EvalConfig, LoggingConfig,
    LoraConfig, ModelConfig, OptimConfig, ParallelConfig, RewardConfig, RolloutConfig, SFTConfig, TrainerConfig,
    all_keys, describe, load_config, to_dict, to_yaml,
)
