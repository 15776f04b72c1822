"""What a model directory says about the run that trained it.

A run's export (`<run>/export`) sits next to that run's `config.yaml`, so `eval`, `score` and `serve`
read the data settings (maximum length, truncation, EOS and chat-template rules) of training from it.
"""

from __future__ import annotations

from pathlib import Path

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
