"""AutoRewardModel: one entry point for Hugging Face directories and GGUF files.

The path picks a format reader (`models.hf`, `models.gguf`); every format then goes through the
same `models.loading.assemble_model` with one `ModelOptions`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from rewardax.errors import ConfigError, ModelLoadError
from rewardax.hub import resolve_model_path
from rewardax.models.config import ModelConfig
from rewardax.models.gguf import open_gguf, smollm2_gguf_path
from rewardax.models.hf import conversion_command, open_hf_directory, read_config_json
from rewardax.models.loading import ModelOptions, assemble_model
from rewardax.models.reward import RewardModel

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class AutoRewardModel:
    """Loads a :class:`RewardModel` from a local checkpoint or a Hugging Face hub name (no torch)."""

    @staticmethod
    def from_pretrained(
        path: str | Path,
        *,
        dtype: Any = "float32",
        param_dtype: Any = None,
        num_labels: int = 1,
        remat_policy: str = "none",
        dropout_rate: float = 0.0,
        seed: int = 0,
        matmul_dtype: Any = None,
        kernels: str = "auto",
    ) -> RewardModel:
        """Load a reward model.

        Args:
          path: a Hugging Face directory (config.json + model.safetensors or a sharded
            ``*.safetensors.index.json``; ``*ForCausalLM`` gets a new score head,
            ``*ForSequenceClassification`` keeps its head) or a ``.gguf`` file; or, when no such
            local path exists, a hub name ``org/name[@revision]`` / ``org/name/file.gguf`` fetched
            into the standard Hugging Face cache (``rewardax.hub``; ``HF_HUB_OFFLINE=1`` reads only
            the cache).
          dtype: compute dtype; param_dtype: storage dtype (default: ``dtype``);
            matmul_dtype: dtype of the projection matmuls' inputs (default: ``dtype``).
          num_labels: width of the score head; must match a loaded head.
          remat_policy, dropout_rate, kernels: see :class:`RewardModel`.
          seed: initialises a new score head.

        Raises:
          ModelLoadError: missing/corrupt files, pickle checkpoints, hub repos not cached
            (offline) or not found, unknown architectures, tensor shape mismatches,
            ``num_labels`` mismatch.
        """
        options = ModelOptions(
            dtype=dtype,
            param_dtype=param_dtype,
            num_labels=num_labels,
            remat_policy=remat_policy,
            dropout_rate=dropout_rate,
            seed=seed,
            matmul_dtype=matmul_dtype,
            kernels=kernels,
        )
        return AutoRewardModel.load(path, options)

    @staticmethod
    def load(path: str | Path, options: ModelOptions) -> RewardModel:
        """:meth:`from_pretrained` with its settings in one :class:`ModelOptions`: what callers
        holding a run config use (``ModelOptions.from_section(config.model, seed=...)``)."""
        path = resolve_model_path(path)
        with _open_tensors(path) as (config, read_tensor, available, source):
            return assemble_model(config, read_tensor, available, options, source=source)


def read_architecture(path: str | Path) -> ModelConfig:
    """The architecture of a model without its weights: a directory's (or a file's) config.json,
    a ``.gguf`` file's metadata, or a hub name's cached snapshot. A directory holding only a
    config.json is enough: ``rewardax plan`` sizes a model from it."""
    path = resolve_model_path(path)
    if path.is_file() and path.suffix == ".gguf":
        with open_gguf(path) as (config, _, _):
            return config
    directory = path.parent if path.is_file() else path
    try:
        return ModelConfig.from_hf_dict(read_config_json(directory))
    except ConfigError as exc:
        raise ModelLoadError(f"{directory / 'config.json'}: {exc}") from exc


@contextmanager
def _open_tensors(
    path: Path,
) -> Iterator[tuple[ModelConfig, Callable[[str], np.ndarray], set[str], str]]:
    """The format reader's (config, read_tensor, available) for `path`, and the name errors use."""
    if path.is_file():
        if path.suffix == ".gguf":
            with open_gguf(path) as found:
                yield (*found, str(path))
            return
        if path.suffix in _PICKLE_SUFFIXES:
            raise ModelLoadError(
                f"{path} is a PyTorch pickle checkpoint; rewardax does not unpickle. Convert "
                f"once with: {conversion_command(path.parent)}"
            )
        if path.name != "config.json" and path.suffix != ".safetensors":
            raise ModelLoadError(
                f"{path}: unknown model file type; pass a Hugging Face directory or a .gguf file."
            )
        path = path.parent
    with open_hf_directory(path) as found:
        yield (*found, str(path))


__all__ = ["AutoRewardModel", "ModelOptions", "read_architecture", "smollm2_gguf_path"]
