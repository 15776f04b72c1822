"""AutoRewardModel: one entry point for Hugging Face directories and GGUF files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rewardax.errors import ModelLoadError
from rewardax.hub import resolve_model_path
from rewardax.models.gguf import load_gguf, smollm2_gguf_path
from rewardax.models.hf import conversion_command, load_hf_directory
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
        path = resolve_model_path(path)
        kwargs: dict[str, Any] = {
            "dtype": dtype,
            "param_dtype": param_dtype,
            "num_labels": num_labels,
            "remat_policy": remat_policy,
            "dropout_rate": dropout_rate,
            "seed": seed,
            "matmul_dtype": matmul_dtype,
            "kernels": kernels,
        }
        if path.is_file():
            if path.suffix == ".gguf":
                return load_gguf(path, **kwargs)
            if path.suffix in _PICKLE_SUFFIXES:
                raise ModelLoadError(
                    f"{path} is a PyTorch pickle checkpoint; rewardax does not unpickle. Convert "
                    f"once with: {conversion_command(path.parent)}"
                )
            if path.name == "config.json" or path.suffix == ".safetensors":
                return load_hf_directory(path.parent, **kwargs)
            raise ModelLoadError(
                f"{path}: unknown model file type; pass a Hugging Face directory or a .gguf file."
            )
        return load_hf_directory(path, **kwargs)


__all__ = ["AutoRewardModel", "smollm2_gguf_path"]
