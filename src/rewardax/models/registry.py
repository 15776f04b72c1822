"""Tensor layout tables: Hugging Face names <-> rewardax parameter paths <-> GGUF names.

One table per config drives import (safetensors, GGUF) and export, so the three cannot drift.
rewardax kernels are ``[in..., out...]`` (heads split out); Hugging Face stores ``[out, in]``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

import numpy as np

from rewardax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

Kind = Literal["copy", "linear", "bias"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter: its HF name, its path in ``nnx.state(RewardModel)``, how to convert.

    Decoder layers are stored stacked (``[num_layers, ...]``, scanned at run time): a per-layer
    Hugging Face tensor is slice ``layer`` of the parameter at ``path``.

    ``kind``: "copy" (same layout: embeddings, norm scales), "linear" (HF ``[out, in]`` matrix
    <-> our kernel whose first ``n_in`` axes are inputs), "bias" (HF flat vector <-> our
    ``[heads, head_dim]``).
    """

    hf_name: str
    path: tuple[str | int, ...]
    kind: Kind
    n_in: int = 1
    layer: int | None = None  # decoder layers are stacked: this tensor is slice `layer` of `path`


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every parameter of ``RewardModel(config)`` with its ``*ForSequenceClassification`` name."""
    specs = [
        TensorSpec("model.embed_tokens.weight", ("model", "embed_tokens", "embedding"), "copy")
    ]
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}"
        ours: tuple[str | int, ...] = ("model", "layers")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs.append(
                TensorSpec(f"{hf}.{norm}.weight", (*ours, norm, "weight"), "copy", layer=i)
            )
        for proj in ("q_proj", "k_proj", "v_proj"):
            specs.append(
                TensorSpec(
                    f"{hf}.self_attn.{proj}.weight",
                    (*ours, "self_attn", proj, "kernel"),
                    "linear",
                    layer=i,
                )
            )
            if config.attention_bias:
                specs.append(
                    TensorSpec(
                        f"{hf}.self_attn.{proj}.bias",
                        (*ours, "self_attn", proj, "bias"),
                        "bias",
                        layer=i,
                    )
                )
        specs.append(
            TensorSpec(
                f"{hf}.self_attn.o_proj.weight",
                (*ours, "self_attn", "o_proj", "kernel"),
                "linear",
                2,
                layer=i,
            )
        )
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                specs.append(
                    TensorSpec(
                        f"{hf}.self_attn.{norm}.weight",
                        (*ours, "self_attn", norm, "weight"),
                        "copy",
                        layer=i,
                    )
                )
        for proj in ("gate_proj", "up_proj", "down_proj"):
            specs.append(
                TensorSpec(
                    f"{hf}.mlp.{proj}.weight", (*ours, "mlp", proj, "kernel"), "linear", layer=i
                )
            )
    specs.append(TensorSpec("model.norm.weight", ("model", "norm", "weight"), "copy"))
    specs.append(TensorSpec("score.weight", ("score", "kernel"), "linear"))
    return specs


def hf_shape(spec: TensorSpec, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of a tensor whose rewardax shape is ``our_shape``."""
    if spec.kind == "linear":
        return (math.prod(our_shape[spec.n_in :]), math.prod(our_shape[: spec.n_in]))
    if spec.kind == "bias":
        return (math.prod(our_shape),)
    return tuple(our_shape)


def to_ours(
    spec: TensorSpec, array: np.ndarray, our_shape: tuple[int, ...], dtype: np.dtype
) -> np.ndarray:
    """HF layout -> rewardax layout in ``dtype``, with a single copy (transpose and cast fused)."""
    if spec.kind == "linear":
        out = np.empty((array.shape[1], array.shape[0]), dtype)
        out[...] = array.T
        return out.reshape(our_shape)
    return array.reshape(our_shape).astype(dtype, copy=False)


def to_hf(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """rewardax layout -> HF layout, C-contiguous.

    Contiguity is not a nicety: on a TPU `jax.device_get` can return a column-major array
    (strides (4, 196608) for a [49152, 32] embedding on a v5e), and safetensors writes the
    buffer as it lies in memory, so the file held the transpose's bytes under the array's shape.
    """
    if spec.kind == "linear":
        array = array.reshape(math.prod(array.shape[: spec.n_in]), -1).T
    elif spec.kind == "bias":
        array = array.reshape(-1)
    return np.ascontiguousarray(array)


# GGUF (llama.cpp) tensor names -> Hugging Face names.
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _GGUF_BLOCK:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}"
    return None


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TensorSpec",
    "gguf_to_hf_name",
    "hf_shape",
    "tensor_specs",
    "to_hf",
    "to_ours",
]
