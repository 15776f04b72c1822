"""ModelConfig: the architecture description shared by the backbone, the importers and the exporter.

One dataclass covers the four supported decoder families; the differences between them are flags:

* ``llama``   — Llama 2/3.x, SmolLM/SmolLM2, TinyLlama (optional Llama-3 RoPE scaling).
* ``mistral`` — Llama + optional sliding-window attention.
* ``qwen2``   — Llama + bias on the q/k/v projections.
* ``qwen3``   — Llama + RMSNorm on q and k per head (``qk_norm``), explicit ``head_dim``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rewardax.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# Hugging Face class-name prefix per architecture (``LlamaForSequenceClassification`` ...).
HF_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}

# RoPE variants we implement; others would silently change the model, so they are refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer with a reward (sequence classification) head.

    Field names follow Hugging Face ``config.json`` so that import/export is a plain mapping.
    ``attention_bias``/``qk_norm`` left ``None`` take the architecture's value (bias for qwen2,
    q/k norm for qwen3). ``head_dim=None`` means ``hidden_size // num_attention_heads``. ``rope_scaling`` is ``None`` or a
    dict with ``rope_type`` in ``("default", "linear", "llama3")`` plus that type's parameters
    (``factor``, and for llama3 ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``). ``sliding_window`` (Mistral) limits attention to keys
    whose position is less than ``sliding_window`` behind the query.
    """

    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    qk_norm: bool | None = None
    sliding_window: int | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    num_labels: int = 1
    initializer_range: float = 0.02
    # Names of the head's outputs (e.g. a multi-objective head's objectives), written to
    # config.json's id2label/label2id; None = transformers' default names LABEL_0, LABEL_1, ...
    label_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # None = the architecture's own choice (q/k/v bias for qwen2, q/k norm for qwen3).
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", self.architecture == "qwen2")
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.architecture == "qwen3")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"ModelConfig.architecture={self.architecture!r} is not supported; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "num_labels",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}.")
        if self.label_names is not None:
            names = tuple(self.label_names)
            object.__setattr__(self, "label_names", names)  # a list compares equal as a tuple
            if len(names) != self.num_labels or len(set(names)) != len(names):
                raise ConfigError(
                    f"ModelConfig.label_names={list(names)} must be {self.num_labels} distinct "
                    "names, one per head output (num_labels), or None."
                )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)."
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly."
            )
        if self.head_dim is None:  # resolved once, so equal configs compare equal
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.resolved_head_dim % 2 != 0:
            raise ConfigError(f"ModelConfig.head_dim={self.resolved_head_dim} must be even (RoPE).")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(
                f"ModelConfig.sliding_window must be None or >= 1, got {self.sliding_window}."
            )
        # Flags that the Hugging Face class of this architecture cannot represent.
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ConfigError("ModelConfig: qwen2 always has q/k/v bias; set attention_bias=True.")
        if self.architecture == "mistral" and self.attention_bias:
            raise ConfigError(
                "ModelConfig: mistral has no attention bias; set attention_bias=False."
            )
        if self.qk_norm != (self.architecture == "qwen3"):
            raise ConfigError(
                f"ModelConfig: qk_norm must be True exactly for qwen3 (got qk_norm={self.qk_norm} "
                f"for {self.architecture})."
            )
        if self.sliding_window is not None and self.architecture != "mistral":
            raise ConfigError(
                f"ModelConfig: sliding_window is only supported for mistral, not {self.architecture}."
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"rope_scaling type {rope_type!r} is not supported; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}."
                )

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width: ``head_dim`` or ``hidden_size // num_attention_heads``."""
        return (
            self.head_dim
            if self.head_dim is not None
            else (self.hidden_size // self.num_attention_heads)
        )

    @property
    def hf_sequence_classification_class(self) -> str:
        """E.g. ``"LlamaForSequenceClassification"``."""
        return f"{HF_CLASS_PREFIX[self.architecture]}ForSequenceClassification"

    def __hash__(self) -> int:
        # The generated hash would fail on the dict/list fields; NNX hashes static module
        # attributes (the config is one) when it caches jitted functions.
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

        Reads ``model_type`` for the architecture; RoPE from ``rope_parameters`` (5.x) or
        ``rope_theta`` + ``rope_scaling`` (4.x). Qwen's ``sliding_window`` is ignored unless
        ``use_sliding_window`` is true (then refused: Qwen's per-layer windows are not implemented).
        ``num_labels`` comes from ``num_labels`` or the size of ``id2label``, default 1;
        ``label_names`` from ``id2label`` unless its names are transformers' defaults (LABEL_i).
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config.json model_type={model_type!r} is not supported; supported "
                f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        for key in ("hidden_act",):
            if d.get(key, "silu") != "silu":
                raise ConfigError(f"config.json {key}={d[key]!r} is not supported (only 'silu').")
        if d.get("mlp_bias"):
            raise ConfigError("config.json mlp_bias=true is not supported.")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        missing = [k for k in (*required, "num_attention_heads") if k not in d]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}.")

        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params:
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            if "type" in rope_scaling and "rope_type" not in rope_scaling:
                rope_scaling["rope_type"] = rope_scaling.pop("type")
            if rope_scaling.get("rope_type", "default") == "default":
                rope_scaling = None

        sliding_window = d.get("sliding_window")
        if model_type in ("qwen2", "qwen3"):
            if d.get("use_sliding_window"):
                raise ConfigError(
                    f"config.json use_sliding_window=true ({model_type}) is not supported: "
                    "Qwen applies the window to some layers only."
                )
            sliding_window = None
        elif model_type == "llama":
            sliding_window = None

        if "num_labels" in d:
            num_labels = int(d["num_labels"])
        elif "id2label" in d:
            num_labels = len(d["id2label"])
        else:
            num_labels = 1
        label_names = None
        id2label = d.get("id2label") or {}
        if len(id2label) == num_labels:
            names = tuple(str(id2label.get(str(i), id2label.get(i))) for i in range(num_labels))
            if names != tuple(f"LABEL_{i}" for i in range(num_labels)):
                label_names = names
        heads = int(d["num_attention_heads"])
        return cls(
            architecture=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=d.get("head_dim"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias (not a config field there).
            attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            pad_token_id=d.get("pad_token_id"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            num_labels=num_labels,
            initializer_range=float(d.get("initializer_range", 0.02)),
            label_names=label_names,
        )

    def to_hf_dict(self, for_sequence_classification: bool = True) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict that transformers 4.x and 5.x both read.

        RoPE is written both ways (``rope_theta``/``rope_scaling`` for 4.x, ``rope_parameters``
        for 5.x). For sequence classification the dict carries ``architectures``, ``num_labels``,
        ``id2label``/``label2id`` and ``pad_token_id`` (transformers' own pooling needs it; it falls
        back to EOS when unset, which is what our tokenizers use for padding).
        """
        prefix = HF_CLASS_PREFIX[self.architecture]
        suffix = "ForSequenceClassification" if for_sequence_classification else "ForCausalLM"
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [f"{prefix}{suffix}"],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.resolved_head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.architecture in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.architecture == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.architecture in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        if for_sequence_classification:
            if d["pad_token_id"] is None:
                eos = self.eos_token_id
                d["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
            d["num_labels"] = self.num_labels
            names = self.label_names or tuple(f"LABEL_{i}" for i in range(self.num_labels))
            d["id2label"] = {str(i): name for i, name in enumerate(names)}
            d["label2id"] = {name: i for i, name in enumerate(names)}
        return d
