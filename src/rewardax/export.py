"""A Hugging Face model directory from a training checkpoint (`rewardax export`).

A checkpoint's `extra` item holds the model architecture (`model_config`, a HF config dict) and the
run's `config`, so the model is rebuilt from the checkpoint alone; the parameters are restored with
`TrainCheckpointer` in read-only mode (the run directory is never modified).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from rewardax.checkpoint import TrainCheckpointer, resolve_resume
from rewardax.config import RewardConfig
from rewardax.errors import CheckpointError, ModelLoadError
from rewardax.models import ModelConfig, ModelOptions, RewardModel, load_tokenizer, lora
from rewardax.optim import build_optimizer, constant_rate
from rewardax.state import RewardState

TOKENIZER_DIRNAME = "tokenizer"  # the trainer's <run>/tokenizer
EXPORT_DIRNAME = "export"


def _read_extra(step_dir: Path) -> dict[str, Any]:
    # Orbax's JsonCheckpointHandler stores the item as `<step>/extra/metadata` (plain JSON). It is
    # read before the state because the state's layout depends on the architecture it names.
    path = step_dir / "extra" / "metadata"
    try:
        extra = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read the checkpoint's extra item {path}: {error}") from None
    missing = [k for k in ("model_config", "config") if k not in extra]
    if missing:
        raise CheckpointError(
            f"{path} lacks {missing}: the checkpoint was written by a rewardax without them; "
            "export the model from the run's `export` directory instead"
        )
    return extra


def _run_dir_of(checkpoints_root: Path) -> Path:
    return checkpoints_root.parent


def load_checkpoint_model(checkpoint: str | os.PathLike) -> tuple[RewardModel, int, Path]:
    """(model, step, run_dir) from a step directory, a checkpoints root or a run directory.

    A root or run directory gives its newest checkpoint that loads.
    """
    target = resolve_resume(os.fspath(Path(checkpoint).expanduser()), Path(checkpoint))
    if target is None:  # only for "auto"/"off", which are not paths here
        raise CheckpointError(f"{checkpoint} holds no committed checkpoint")
    with TrainCheckpointer(target.root, max_to_keep=None, read_only=True) as ckpt:
        step = target.step if target.step is not None else ckpt.latest_step()
        if step is None:
            raise CheckpointError(f"no committed checkpoint under {target.root}")
        extra = _read_extra(ckpt.step_path(step))
        config = RewardConfig.from_dict(extra["config"], source=f"checkpoint {step} config")
        model_config = ModelConfig.from_hf_dict(extra["model_config"])
        # The run's model settings; the head is as wide as the checkpoint's architecture says.
        options = ModelOptions.from_section(config.model).replace(
            num_labels=model_config.num_labels
        )

        def build_model() -> RewardModel:  # with the run's adapters, as the trainer added them
            return lora.add_configured_adapters(options.build(model_config), config.model)

        optimizer = build_optimizer(constant_rate(config.optim), 1)  # for its state layout
        # Shapes only: no parameter is initialised just to be overwritten.
        abstract = jax.eval_shape(lambda: RewardState.create(build_model(), optimizer).arrays())
        graphdef = lora.split(nnx.eval_shape(build_model))[0]
        step, arrays, _ = ckpt.restore(abstract, step)
    model = nnx.merge(graphdef, arrays["params"], arrays["rest"])
    return model, int(step), _run_dir_of(target.root)


def export_checkpoint(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    tokenizer_path: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Writes the Hugging Face `*ForSequenceClassification` directory of a checkpoint.

    Args:
      checkpoint: a step directory (`<run>/checkpoints/120`), a checkpoints root or a run directory.
      output: the directory to write; a non-empty one is refused unless `overwrite`.
      tokenizer_path: the tokenizer to ship with the model; default `<run>/tokenizer` when present.
      overwrite: replace a non-empty `output`.

    Returns:
      {"export_dir", "step", "run_dir", "tokenizer", "reward_normalization"}. The reward
      normalisation is copied from `<run>/export` only when that export holds the same step (the
      statistics describe those weights, not any other step's).
    """
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise ModelLoadError(f"{output} exists and is not empty; pass --overwrite to replace it")
    model, step, run_dir = load_checkpoint_model(checkpoint)
    if lora.has_adapters(model):  # a plain *ForSequenceClassification: adapters merged
        model = lora.merged(model)
    tokenizer = None
    if tokenizer_path is None and (run_dir / TOKENIZER_DIRNAME).is_dir():
        tokenizer_path = run_dir / TOKENIZER_DIRNAME
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path)
    info: dict[str, Any] = {"trained_steps": step}
    run_export = run_dir / EXPORT_DIRNAME / "config.json"
    normalization = None
    if run_export.is_file():
        stored = json.loads(run_export.read_text(encoding="utf-8")).get("rewardax") or {}
        if stored.get("trained_steps") == step and "reward_normalization" in stored:
            normalization = stored["reward_normalization"]
            info["reward_normalization"] = normalization
    model.save_pretrained(
        output, tokenizer=tokenizer, extra_config={"rewardax": info}, overwrite=overwrite
    )
    return {
        "export_dir": str(output),
        "step": step,
        "run_dir": str(run_dir),
        "tokenizer": str(tokenizer_path) if tokenizer_path is not None else None,
        "reward_normalization": normalization,
    }
