"""The config tree of `mmpg train` / `mmpg sft` and its checks, one package:

    tree.py       the dataclasses, every field with its help text (`setting`); VideoSettings, the video block that
                  training's data.* and `mmpg eval`'s settings share
    load.py       defaults <- YAML <- `key=value` overrides, each refusal one UserError line; `--fields` (describe)
    checks.py     the value checks run after the merge: string choices and ranges
    reference.py  docs/config.md generated from the tree (`python -m mmpg.config.reference > docs/config.md`)

`from mmpg.config import Config, load_config` is the way in; the names below are what callers use.
"""

from mmpg.config.checks import CHOICES, validate, video_checks
from mmpg.config.load import config_field, describe, load_config, omegaconf_error, quote_text, to_dict, to_yaml
from mmpg.config.tree import (
    GROUPS, AlgorithmConfig, CheckpointConfig, Config, DataConfig, DeepSpeedConfig, EvalConfig, LoggingConfig,
    LoraConfig, ModelConfig, OptimConfig, ParallelConfig, RewardConfig, RolloutConfig, SFTConfig, TrainerConfig,
    VideoSettings, all_keys, setting,
)
