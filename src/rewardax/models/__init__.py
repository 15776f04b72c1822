"""Reward models: NNX decoder backbones with a score head; HF/GGUF import, HF export."""

from rewardax.models.auto import AutoRewardModel
from rewardax.models.config import ModelConfig
from rewardax.models.gguf import smollm2_gguf_path
from rewardax.models.loading import ModelOptions
from rewardax.models.reward import RewardModel, RewardOutput
from rewardax.models.tokenizer import load_tokenizer

__all__ = [
    "AutoRewardModel",
    "ModelConfig",
    "ModelOptions",
    "RewardModel",
    "RewardOutput",
    "load_tokenizer",
    "smollm2_gguf_path",
]
