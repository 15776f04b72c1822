"""Helpers shared by the model tests: tiny random transformers models and padded batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 97
EOS = 2

# Llama-3 scaling with a tiny original context so that all three frequency bands (kept,
# interpolated, divided by the factor) occur at head_dim 16.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A small transformers config (hidden 64, 2 layers, 4 heads, 2 kv heads) for ``arch``."""
    import transformers as t

    cls = {
        "llama": t.LlamaConfig,
        "llama3": t.LlamaConfig,
        "mistral": t.MistralConfig,
        "qwen2": t.Qwen2Config,
        "qwen3": t.Qwen3Config,
    }[arch]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "pad_token_id": EOS,  # pad == EOS, as in SmolLM2
        "num_labels": 1,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    if arch == "llama3":
        kwargs["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": 10000.0}
    if arch == "mistral":
        kwargs["sliding_window"] = 4
    if arch == "qwen3":
        kwargs["head_dim"] = 24  # != hidden/heads, as in real Qwen3
    kwargs.update(overrides)
    return cls(**kwargs)


def randomize_(model: Any, seed: int = 0) -> Any:
    """Overwrite every torch parameter with O(0.1) noise (HF's 0.02 init makes near-zero outputs
    where layout bugs hide); norm scales around 1."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("score.weight"):
                p.copy_(noise)
            else:
                p.copy_(0.15 * noise)
    return model


def save_tiny_torch_model(arch: str, directory: Path, *, causal: bool = False, **overrides: Any):
    """Build, randomise and ``save_pretrained`` a tiny torch model; returns (model, config)."""
    import torch
    import transformers as t

    torch.manual_seed(0)
    config = tiny_hf_config(arch, **overrides)
    cls = t.AutoModelForCausalLM if causal else t.AutoModelForSequenceClassification
    model = cls.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model)
    model.eval()
    model.save_pretrained(str(directory))
    return model, config


def random_rows(seed: int, lengths: list[int]) -> list[list[int]]:
    """Token rows of the given lengths, each ending with EOS (so pad == EOS matters)."""
    rng = np.random.default_rng(seed)
    return [[*rng.integers(3, VOCAB, size=n - 1).tolist(), EOS] for n in lengths]


def pad_rows(rows: list[list[int]], side: str, pad_id: int = EOS) -> tuple[np.ndarray, np.ndarray]:
    """Pad to the longest row on ``side`` ("left" or "right"): (ids int32 [N,T], mask [N,T])."""
    t = max(len(r) for r in rows)
    ids = np.full((len(rows), t), pad_id, np.int32)
    mask = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        if side == "right":
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        else:
            ids[i, t - len(r) :], mask[i, t - len(r) :] = r, 1
    return ids, mask


def torch_rewards(model: Any, rows: list[list[int]]) -> np.ndarray:
    """Reference rewards [N, num_labels]: each row run alone (no padding), score at its end."""
    import torch

    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r])
            hidden = model.model(input_ids=ids).last_hidden_state
            out.append(model.score(hidden)[0, -1].numpy())
    return np.stack(out)


def tiny_config(arch: str, **overrides: Any) -> Any:
    """The rewardax ModelConfig equivalent of ``tiny_hf_config`` (no torch needed)."""
    from rewardax.models import ModelConfig

    kwargs: dict[str, Any] = {
        "architecture": "llama" if arch == "llama3" else arch,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
    }
    if arch == "llama3":
        kwargs["rope_scaling"] = dict(LLAMA3_ROPE)
    if arch == "mistral":
        kwargs["sliding_window"] = 4
    if arch == "qwen3":
        kwargs["head_dim"] = 24
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def scrambled_model(arch: str, seed: int = 0, **kwargs: Any) -> Any:
    """A RewardModel whose parameters are O(0.1) noise (norm scales ~1), like ``randomize_``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rewardax.models import RewardModel

    config_overrides = kwargs.pop("config_overrides", {})
    model = RewardModel(tiny_config(arch, **config_overrides), rngs=nnx.Rngs(seed), **kwargs)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    new = []
    for path, leaf, key in zip(paths, leaves, keys, strict=True):
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        is_norm = "weight" in jax.tree_util.keystr(path)  # RMSNorm scales are named "weight"
        value = 1.0 + 0.2 * noise if is_norm else 0.15 * noise
        if "score" in jax.tree_util.keystr(path):
            value = noise
        new.append(value.astype(leaf.dtype))
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model
