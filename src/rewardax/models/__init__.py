"""Reward models: NNX decoder backbones with a score head; HF/GGUF import, HF export."""

from rewardax.models.config import ModelConfig
from rewardax.models.reward import RewardModel, RewardOutput

__all__ = ["ModelConfig", "RewardModel", "RewardOutput"]
