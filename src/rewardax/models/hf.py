"""Hugging Face safetensors directories (no torch): reading them for `models.loading`, and
writing a model as a ``*ForSequenceClassification`` directory (`save_pretrained`).

Reading only says what a directory holds (`open_hf_directory`: architecture, tensor reader,
tensor names); `models.loading.assemble_model` builds the model. This module does not import
`models.reward`, which imports it for ``RewardModel.save_pretrained``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from rewardax.errors import ConfigError, ModelLoadError
from rewardax.models.config import ModelConfig
from rewardax.models.registry import tensor_specs, to_hf

# transformers writes shards of at most this many bytes by default for big models; we follow.
MAX_SHARD_BYTES = 2 * 1024**3


def read_config_json(directory: Path) -> dict[str, Any]:
    """A Hugging Face directory's config.json as a dict; ModelLoadError when absent or not JSON."""
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no config.json; not a Hugging Face model directory.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc}).") from exc


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF directory (single file or index)."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{indexes[0]}: not a valid safetensors index ({exc}).") from exc
        files = [directory / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{indexes[0]} lists missing shard(s): {', '.join(absent)}.")
        return files
    singles = sorted(directory.glob("*.safetensors"))
    if singles:
        return (
            [directory / "model.safetensors"]
            if (directory / "model.safetensors").is_file()
            else singles
        )
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
        raise ModelLoadError(
            f"{directory}: only PyTorch pickle weights (*.bin/*.pt) found; rewardax does not "
            "unpickle (arbitrary code execution). Convert once with: "
            + conversion_command(directory)
        )
    raise ModelLoadError(f"{directory}: no *.safetensors weights found next to config.json.")


def conversion_command(path: Path) -> str:
    """A one-line command that rewrites a pickle checkpoint as safetensors."""
    return (
        'python -c "import transformers as t; '
        f"t.AutoModel.from_pretrained('{path}').save_pretrained('{path}-safetensors')\""
        " (use AutoModelForCausalLM / AutoModelForSequenceClassification to keep the head)"
    )


_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


class SafetensorsFile:
    """Minimal safetensors reader that reads each tensor with plain file I/O.

    The ``safetensors`` package memory-maps the file; every page it touches then counts in the
    process's resident memory until the file is closed, which would add a second model copy to
    the loading peak. Reading into a fresh array keeps only the tensor being converted.
    Format: 8-byte little-endian header length, JSON header {name: {dtype, shape,
    data_offsets}}, then the data.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
            size = path.stat().st_size
            (n,) = np.frombuffer(self._file.read(8), dtype="<u8")
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(self._file.read(int(n)))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: cannot read safetensors file ({exc}).") from exc
        if not isinstance(header, dict):
            raise ModelLoadError(f"{path}: cannot read safetensors file (header is not a map).")
        header.pop("__metadata__", None)
        for name, info in header.items():
            if not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= set(info)):
                raise ModelLoadError(f"{path}: corrupt safetensors header entry for {name}.")
        self._start = 8 + int(n)
        self._size = size
        self.header: dict[str, dict[str, Any]] = header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(
                f"{self.path}: tensor {name} has dtype {info['dtype']}; expected a float type."
            )
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != dtype.itemsize * math.prod(shape) or self._start + end > self._size:
            raise ModelLoadError(f"{self.path}: tensor {name} is truncated or corrupt.")
        out = np.empty(shape, dtype)
        self._file.seek(self._start + begin)
        if self._file.readinto(memoryview(out.reshape(-1).view(np.uint8))) != end - begin:
            raise ModelLoadError(f"{self.path}: tensor {name} is truncated.")
        return out

    def close(self) -> None:
        self._file.close()


def _open_all(files: list[Path], stack: ExitStack) -> dict[str, tuple[SafetensorsFile, str]]:
    """HF name -> (open file, name inside the file); a bare ``*Model`` checkpoint (no
    ``model.`` prefix) is mapped onto the ``model.`` names."""
    handles: dict[str, tuple[SafetensorsFile, str]] = {}
    for f in files:
        handle = SafetensorsFile(f)
        stack.callback(handle.close)
        for name in handle.header:
            handles[name] = (handle, name)
    if "model.embed_tokens.weight" not in handles and "embed_tokens.weight" in handles:
        handles = {f"model.{k}": v for k, v in handles.items()}
    return handles


@contextmanager
def open_hf_directory(
    directory: str | Path,
) -> Iterator[tuple[ModelConfig, Callable[[str], np.ndarray], set[str]]]:
    """What a HF directory holds: (architecture, tensor reader, tensor names), for
    ``models.loading.assemble_model``; the weight files stay open until the block ends.

    The architecture comes from config.json (``*ForCausalLM``: no ``score.weight``, a new head
    is made; ``*ForSequenceClassification``: its head is read). Tensors are named as in
    ``*ForSequenceClassification`` (a causal LM's ``model.`` prefix added where missing).
    """
    directory = Path(directory)
    try:
        config = ModelConfig.from_hf_dict(read_config_json(directory))
    except ConfigError as exc:
        raise ModelLoadError(f"{directory / 'config.json'}: {exc}") from exc
    files = _weight_files(directory)
    with ExitStack() as stack:
        handles = _open_all(files, stack)

        def read(name: str) -> np.ndarray:
            handle, raw = handles[name]
            return handle.read(raw)

        yield config, read, set(handles)


def _hf_tensors(model: nnx.Module) -> Iterator[tuple[str, np.ndarray]]:
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for spec in tensor_specs(model.config):
        value = variables[spec.path][...]
        if spec.layer is not None:
            value = value[spec.layer]
        yield spec.hf_name, to_hf(spec, np.asarray(jax.device_get(value)))


def _pad_distinct_from_eos(tokenizer: Any) -> Any:
    """A copy of `tokenizer` whose pad token is not its EOS token, when it can be arranged.

    transformers' `*ForSequenceClassification` reads the reward at the last token that is not
    `pad_token_id`; with pad == EOS (SmolLM2, Llama 3) a response ending in EOS is read one token
    early. rewardax never searches for the pad id, but the exported model is loaded by others:
    pad with an existing special token that ends no response (unk, else bos). The caller's
    tokenizer is not modified.
    """
    if tokenizer is None or getattr(tokenizer, "pad_token_id", None) is None:
        return tokenizer
    eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer.pad_token_id != eos:
        return tokenizer
    for name in ("unk_token", "bos_token"):
        token = getattr(tokenizer, name, None)
        token_id = getattr(tokenizer, f"{name}_id", None)
        if token is not None and token_id is not None and token_id != eos:
            distinct = copy.deepcopy(tokenizer)
            distinct.pad_token = token
            return distinct
    return tokenizer


def save_pretrained(
    model: nnx.Module,
    directory: str | Path,
    *,
    tokenizer: Any = None,
    extra_config: dict[str, Any] | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write ``model`` (a ``RewardModel``) as a HF ``*ForSequenceClassification`` directory;
    returns its path.

    Writes config.json (``architectures``, ``num_labels``, ``pad_token_id``, ``dtype`` and any
    ``extra_config`` keys, e.g. reward normalisation statistics), ``model.safetensors`` (or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` past
    ``max_shard_bytes``) and the tokenizer files. Written in a temporary sibling directory and
    renamed into place, so a crash never leaves a half-written model behind.
    """
    from safetensors.numpy import save_file

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ModelLoadError(f"{directory} is a file; save_pretrained needs a directory path.")
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise ModelLoadError(
            f"{directory} exists and is not empty; choose another directory or pass overwrite=True."
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        hf_config = model.config.to_hf_dict(for_sequence_classification=True)
        tokenizer = _pad_distinct_from_eos(tokenizer)
        if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
            hf_config["pad_token_id"] = int(tokenizer.pad_token_id)
        hf_config["dtype"] = model.param_dtype.name
        hf_config.update(extra_config or {})

        shards: list[dict[str, np.ndarray]] = [{}]
        sizes = [0]
        names: list[str] = []
        for name, array in _hf_tensors(model):
            if sizes[-1] and sizes[-1] + array.nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][name] = array
            sizes[-1] += array.nbytes
            names.append(name)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        del shards
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if directory.exists():
            trash = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(directory, trash)
            os.replace(tmp, directory)
            shutil.rmtree(trash)
        else:
            os.replace(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return directory
