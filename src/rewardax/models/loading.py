"""From checkpoint tensors to a RewardModel: the one assembly path, whatever the file format.

A format reader (`models.hf.open_hf_directory` for safetensors directories, `models.gguf.open_gguf`
for GGUF files) says what a file holds: the architecture (`ModelConfig`), a function reading one
tensor by its Hugging Face name, and the names it can serve. `ModelOptions` says how the caller
wants the model built (dtypes, head width, remat, dropout, head seed, kernels). `assemble_model`
combines the two.

Assembly streams tensor by tensor: the model is first built abstractly (``nnx.eval_shape``: shapes
only, no memory), then each parameter is read, converted to rewardax's layout and the target
dtype, and placed; host memory peaks at about one model copy plus one tensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from rewardax.errors import ModelLoadError
from rewardax.models.config import ModelConfig
from rewardax.models.kernels import compute_dtype
from rewardax.models.registry import hf_shape, tensor_specs, to_ours
from rewardax.models.reward import RewardModel

_IGNORED_TENSORS = ("lm_head.weight",)  # causal-LM head: a reward model does not use it
_HEAD = "score.weight"


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How to build a :class:`RewardModel`, apart from its architecture (:class:`ModelConfig`).

    Built once by each caller (``AutoRewardModel.from_pretrained``'s keyword arguments, a run
    config's ``model:`` section via :meth:`from_section`) and passed down unchanged.

    Attributes:
      dtype: compute dtype.
      param_dtype: storage dtype of the parameters; None: ``dtype``.
      num_labels: width of the score head; a head found in the checkpoint must be as wide.
      label_names: names of the head's outputs (``model.objectives``); None keeps the
        checkpoint's names when its head is as wide (else transformers' LABEL_i).
      remat_policy, dropout_rate, kernels: see :class:`RewardModel`.
      seed: initialises a new score head (and dropout's RNG state).
      matmul_dtype: dtype of the projection matmuls' inputs; None: ``dtype``.

    Example::

        options = ModelOptions(dtype="bfloat16", num_labels=1, seed=3)
        model = AutoRewardModel.load("path/to/model", options)
    """

    dtype: Any = "float32"
    param_dtype: Any = None
    num_labels: int = 1
    label_names: tuple[str, ...] | None = None
    remat_policy: str = "none"
    dropout_rate: float = 0.0
    seed: int = 0
    matmul_dtype: Any = None
    kernels: str = "auto"

    @classmethod
    def from_section(cls, section: Any, *, seed: int = 0) -> ModelOptions:
        """The options a run config's ``model:`` section (``rewardax.config.ModelSection``) names:
        every field but ``path``; ``seed`` (the run's ``train.seed``) initialises a new head."""
        return cls(
            dtype=section.dtype,
            param_dtype=section.param_dtype,
            num_labels=section.head_width,
            label_names=tuple(section.objectives) if section.objectives else None,
            # `auto` is decided by the trainer and `plan`, which compile the train step; anything
            # else that builds from a section (scoring) differentiates nothing.
            remat_policy="none" if section.remat_policy == "auto" else section.remat_policy,
            dropout_rate=section.dropout_rate,
            seed=seed,
            matmul_dtype=section.matmul_dtype,
            kernels=section.kernels,
        )

    def replace(self, **changes: Any) -> ModelOptions:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def for_inference(self) -> ModelOptions:
        """These options for scoring: no dropout, no remat (nothing is differentiated)."""
        return self.replace(dropout_rate=0.0, remat_policy="none")

    @property
    def storage_dtype(self) -> Any:
        """The parameters' dtype: ``param_dtype``, or ``dtype`` (`auto`: the backend's compute
        dtype, `kernels.compute_dtype`) when that is None."""
        return self.param_dtype if self.param_dtype is not None else compute_dtype(self.dtype)

    def build(self, config: ModelConfig) -> RewardModel:
        """``RewardModel(config)`` with these options and parameters initialised from ``seed``; the
        head is ``num_labels`` wide. Under ``nnx.eval_shape`` it costs no memory."""
        names = self.label_names
        if names is None and config.num_labels == self.num_labels:
            names = config.label_names
        return RewardModel(
            config.replace(num_labels=self.num_labels, label_names=names),
            dtype=self.dtype,
            param_dtype=self.storage_dtype,
            remat_policy=self.remat_policy,
            dropout_rate=self.dropout_rate,
            rngs=nnx.Rngs(self.seed),
            matmul_dtype=self.matmul_dtype,
            kernels=self.kernels,
        )


def _np_dtype(dtype: Any) -> np.dtype:
    dt = jnp.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if dt == jnp.bfloat16 else np.dtype(dt.name)


def _check_head(
    read_tensor: Callable[[str], np.ndarray], available: set[str], num_labels: int, source: str
) -> None:
    """A checkpoint's own score head must be as wide as asked (before any big tensor is read)."""
    if _HEAD not in available:
        return
    rows = read_tensor(_HEAD).shape[0]
    if rows != num_labels:
        raise ModelLoadError(
            f"{source}: the checkpoint's score head has {rows} label(s) but "
            f"num_labels={num_labels} was asked; pass num_labels={rows}, or load the "
            "backbone from a *ForCausalLM checkpoint to get a new head."
        )


def assemble_model(
    config: ModelConfig,
    read_tensor: Callable[[str], np.ndarray],
    available: set[str],
    options: ModelOptions,
    *,
    source: str,
) -> RewardModel:
    """Build ``RewardModel(config)`` from HF-named tensors, one tensor in host memory at a time.

    Args:
      config: the checkpoint's architecture; its head width is replaced by ``options.num_labels``.
      read_tensor: HF tensor name (``*ForSequenceClassification`` naming) -> array in HF layout.
      available: the names ``read_tensor`` can serve. Without ``score.weight`` a new head is
        initialised (std 1/sqrt(hidden+1), from ``options.seed``).
      options: dtypes, head width, remat, dropout, seed and kernels of the model built.
      source: file or directory named in error messages.

    Raises:
      ModelLoadError: tensors missing, unexpected or of the wrong shape; a head of another width.
    """
    _check_head(read_tensor, available, options.num_labels, source)
    names = options.label_names
    if names is None and config.num_labels == options.num_labels:
        names = config.label_names
    config = config.replace(num_labels=options.num_labels, label_names=names)
    abstract = nnx.eval_shape(lambda: options.build(config))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    variables = dict(nnx.to_flat_state(params))
    specs = tensor_specs(config)
    needed = {s.hf_name for s in specs}
    unexpected = sorted(available - needed - set(_IGNORED_TENSORS))
    unexpected = [n for n in unexpected if not n.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise ModelLoadError(
            f"{source}: tensors not used by a {config.architecture} model with this config.json: "
            f"{', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}. "
            "The checkpoint is probably a different architecture variant."
        )
    missing = sorted(needed - available - {_HEAD})
    if missing:
        raise ModelLoadError(
            f"{source}: missing tensors: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}. The file is incomplete or truncated."
        )
    target = _np_dtype(options.storage_dtype)
    # Stacked layer parameters are filled slice by slice in a host buffer and moved to the device
    # once complete. Going parameter by parameter (all layers of one before the next) keeps a
    # single host buffer alive, so the peak stays near one model copy plus one stacked tensor.
    first_seen = {path: i for i, path in reversed(list(enumerate(s.path for s in specs)))}
    specs = sorted(specs, key=lambda s: (first_seen[s.path], s.layer or 0))
    buffers: dict[tuple, np.ndarray] = {}
    last_layer = config.num_hidden_layers - 1
    for spec in specs:
        var = variables[spec.path]
        shape = tuple(var.get_value().shape)
        if spec.layer is not None:
            shape = shape[1:]
        if spec.hf_name == _HEAD and spec.hf_name not in available:
            key = jax.random.key(options.seed)
            std = 1.0 / math.sqrt(config.hidden_size + 1)
            var.set_value((std * jax.random.normal(key, shape, jnp.float32)).astype(target))
            continue
        array = read_tensor(spec.hf_name)
        expected = hf_shape(spec, shape)
        if tuple(array.shape) != expected:
            raise ModelLoadError(
                f"{source}: tensor {spec.hf_name} has shape {tuple(array.shape)} but config.json "
                f"implies {expected}."
            )
        converted = to_ours(spec, array, shape, target)
        del array
        if spec.layer is None:
            var.set_value(jnp.asarray(converted))
            continue
        if spec.path not in buffers:
            buffers[spec.path] = np.empty((config.num_hidden_layers, *shape), target)
        buffers[spec.path][spec.layer] = converted
        if spec.layer == last_layer:
            var.set_value(jnp.asarray(buffers.pop(spec.path)))
    params = nnx.from_flat_state(variables)
    if jax.tree.leaves(rest):
        # Dropout RNG state: built by a jitted init whose parameter computations XLA drops.
        rest = jax.jit(lambda: nnx.split(options.build(config), nnx.Param, ...)[2])()
    return nnx.merge(graphdef, params, rest)
