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
    names = [] if run_config else label_names_of(model)
    if names:  # a multi-objective export outside its run: its head and names from config.json
        overrides = [f"model.objectives=[{','.join(names)}]", "train.loss=mse", *overrides]
    return config.with_overrides([f"model.path={model}", *overrides])


def label_names_of(model: str) -> list[str]:
    """The named outputs of a model directory's head (config.json's id2label unless it holds
    transformers' default LABEL_i names); [] for anything else."""
    import json

    path = Path(model) / "config.json"
    if not path.is_file():
        return []
    try:
        id2label = json.loads(path.read_text(encoding="utf-8")).get("id2label") or {}
        names = [str(id2label[str(i)]) for i in range(len(id2label))]
    except (OSError, ValueError, KeyError, AttributeError):
        return []
    if names == [f"LABEL_{i}" for i in range(len(names))]:
        return []
    return names


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
    options = ModelOptions(
        dtype=config.model.dtype,
        num_labels=config.model.head_width,
        label_names=tuple(config.model.objectives) if config.model.objectives else None,
    )
    return path, config, tokenizer, AutoRewardModel.load(path, options)
