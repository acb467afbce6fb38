"""Typed run configuration: the sections (sections.py), loading them from YAML plus `key=value`
overrides (loading.py) and the cross-field checks run before any model is built (validation.py).

`load_config(path, overrides).validate()` is the usual entry; importing this package is cheap
(no torch): the algorithm registries are imported only inside `validate`.
"""
from .loading import ConfigError, config_from_dict, config_to_dict, load_config, parse_override
from .sections import (ActorConfig, AlgoConfig, Config, DataConfig, ModelConfig, ParallelConfig, RewardConfig,
                       RolloutConfig, SyntheticTaskConfig, TinyModelConfig, TrainerConfig)
from .validation import validate

__all__ = ["ConfigError", "config_from_dict", "config_to_dict", "load_config", "parse_override", "ActorConfig",
           "AlgoConfig", "Config", "DataConfig", "ModelConfig", "ParallelConfig", "RewardConfig", "RolloutConfig",
           "SyntheticTaskConfig", "TinyModelConfig", "TrainerConfig", "validate"]
