"""rewardax: train reward models for RLHF in JAX.

The public surface; everything else may move between releases.
"""

from rewardax.config import RewardConfig
from rewardax.data import ShardedDataSource
from rewardax.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    ModelLoadError,
    NonFiniteError,
    RewardaxError,
)
from rewardax.models import AutoRewardModel, ModelConfig, RewardModel, RewardOutput, load_tokenizer
from rewardax.serve import reward_function
from rewardax.state import RewardState
from rewardax.trainer import RewardTrainer, TrainResult

__version__ = "0.1.0"

__all__ = [
    "AutoRewardModel",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "ModelConfig",
    "ModelLoadError",
    "NonFiniteError",
    "RewardConfig",
    "RewardModel",
    "RewardOutput",
    "RewardState",
    "RewardTrainer",
    "RewardaxError",
    "ShardedDataSource",
    "TrainResult",
    "load_tokenizer",
    "reward_function",
]
