"""What a model directory says about the run that trained it.

A run's export (`<run>/export`) sits next to that run's `config.yaml`, so `eval`, `score` and `serve`
read the data settings (maximum length, truncation, EOS and chat-template rules) of training from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rewardax.config import RewardConfig


def run_config_path(model_dir: str) -> Path | None:
    """`<run>/config.yaml` when the model is a run's export directory (`<run>/export`)."""
    candidate = Path(model_dir).resolve().parent / "config.yaml"
    return candidate if Path(model_dir).is_dir() and candidate.is_file() else None


def config_for_model(model: str, overrides: list[str]) -> RewardConfig:
    """The run's RewardConfig when `model` is `<run>/export` (so data settings match training),
    else the defaults; then `overrides`."""
    run_config = run_config_path(model)
    config = RewardConfig.from_yaml(run_config) if run_config else RewardConfig()
    return config.with_overrides([f"model.path={model}", *overrides])


def load_for_scoring(
    model: str, overrides: list[str], tokenizer_path: str | None = None
) -> tuple[str, RewardConfig, Any, Any]:
    """(path, config, tokenizer, model) as `rewardax score` and `rewardax serve` load them: the
    model directory, .gguf file or hub name resolved, the run's data settings (then `overrides`),
    its tokenizer (or `tokenizer_path`), and the model in the config's dtype."""
    from rewardax.hub import resolve_model_path
    from rewardax.models import AutoRewardModel, ModelOptions, load_tokenizer

    path = str(resolve_model_path(model))
    config = config_for_model(path, overrides)
    tokenizer = load_tokenizer(tokenizer_path or path)
    options = ModelOptions(dtype=config.model.dtype, num_labels=config.model.num_labels)
    return path, config, tokenizer, AutoRewardModel.load(path, options)
