"""LoRA: low-rank adapters on a reward model's projections, the score head trained in full.

``add_adapters`` gives each targeted `transformer.Projection` two float32 matrices, ``lora_a``
[*in_shape, r] (random, std 1/sqrt(fan-in)) and ``lora_b`` [r, *out_shape] (zeros), so that the
projection computes ``x @ W + (alpha / r) * (x @ A) @ B``; with B = 0 the model starts as the base
model (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"). The adapters are
`LoraParam` variables: `trainable` selects them and the score head, the rest of the model (the
frozen base, stored in ``base_dtype``) is not differentiated and has no optimizer state.

``merged`` folds the adapters into the kernels (float32) and drops them: the result is a plain
`RewardModel` whose export is an ordinary ``*ForSequenceClassification`` directory, with the score
head's trained values (users of other trainers report heads lost or re-initialised after LoRA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rewardax.errors import ConfigError
from rewardax.models.transformer import Projection

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraParam(nnx.Param):
    """A LoRA adapter matrix (trained; the base parameters around it are frozen)."""


def _projections(model: nnx.Module, targets: Sequence[str]):
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Projection) and path and path[-1] in targets:
            yield path, module


def has_adapters(model: nnx.Module) -> bool:
    return any(getattr(m, "lora_a", None) is not None for _, m in nnx.iter_graph(model))


def trainable(model: nnx.Module) -> Any:
    """The nnx filter of the parameters a step differentiates and updates: every `nnx.Param`, or,
    once the model has adapters, the adapters and the score head."""
    if not has_adapters(model):
        return nnx.Param
    return nnx.Any(LoraParam, nnx.All(nnx.Param, nnx.PathContains("score")))


def split(model: nnx.Module) -> tuple[Any, nnx.State, nnx.State]:
    """``(graphdef, trainable parameters, everything else)``."""
    return nnx.split(model, trainable(model), ...)


def add_adapters(
    model: nnx.Module,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] = LORA_TARGETS,
    seed: int = 0,
    base_dtype: Any = None,
) -> nnx.Module:
    """Adds adapters to ``model``'s targeted projections, in place, and returns it.

    Args:
      rank: r, the adapters' inner width.
      alpha: the adapters' output is scaled by alpha / r.
      targets: projection names among `LORA_TARGETS`.
      seed: draws the A matrices.
      base_dtype: the frozen parameters' dtype (e.g. "bfloat16"); None keeps theirs. The score
        head and the adapters are float32.
    """
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if rank < 1 or unknown or not targets:
        raise ConfigError(
            f"LoRA needs rank >= 1 (got {rank}) and targets among {', '.join(LORA_TARGETS)}"
            + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    if has_adapters(model):
        raise ConfigError("the model already has LoRA adapters")
    key = jax.random.key(seed)
    found = list(_projections(model, targets))
    if not found:
        raise ConfigError(f"no projection named {', '.join(targets)} in the model")
    for i, (_, proj) in enumerate(found):
        kernel = proj.kernel
        names = tuple(kernel.get_metadata().get("out_sharding") or ())
        shape = tuple(kernel[...].shape)
        lead = 1 if names[:1] == ("layers",) else 0
        in_shape = shape[lead : lead + proj.n_in]
        out_shape = shape[lead + proj.n_in :]
        std = 1.0 / math.sqrt(math.prod(in_shape))
        a = std * jax.random.normal(
            jax.random.fold_in(key, i), (*shape[:lead], *in_shape, rank), jnp.float32
        )
        b = jnp.zeros((*shape[:lead], rank, *out_shape), jnp.float32)
        n_in = lead + proj.n_in
        proj.lora_a = LoraParam(a, out_sharding=(*names[:n_in], None), eager_sharding=False)
        proj.lora_b = LoraParam(
            b, out_sharding=(*names[:lead], None, *names[n_in:]), eager_sharding=False
        )
        proj.lora_scale = alpha / rank
    if base_dtype is not None:
        dtype = jnp.dtype(base_dtype)
        for path, variable in nnx.iter_graph(model):
            if isinstance(variable, nnx.Param) and not isinstance(variable, LoraParam):
                wanted = jnp.float32 if "score" in path else dtype
                variable.set_value(variable[...].astype(wanted))
    return model


def add_configured_adapters(model: nnx.Module, section: Any, *, seed: int = 0) -> nnx.Module:
    """`add_adapters` with a run config's ``model:`` section (``rewardax.config.ModelSection``)
    when its ``lora_rank`` is set and the model has none yet; else the model as it is. The trainer,
    `rewardax export` and `rewardax plan` build the same adapted model through it."""
    if not section.lora_rank or has_adapters(model):
        return model
    return add_adapters(
        model,
        rank=section.lora_rank,
        alpha=section.lora_alpha,
        targets=section.lora_targets,
        seed=seed,
        base_dtype=section.param_dtype,
    )


def delta(proj: Projection) -> jax.Array:
    """(alpha / r) * A @ B in the kernel's layout, float32."""
    a, b = proj.lora_a[...], proj.lora_b[...]
    lead = a.ndim - proj.n_in - 1
    a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])
    b2 = b.reshape(*b.shape[: lead + 1], -1)
    out = jnp.matmul(a2, b2, precision="highest") * proj.lora_scale
    return out.reshape(*a.shape[:-1], *b.shape[lead + 1 :])


def merged(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with each adapter folded into its kernel (float32) and removed."""
    model = nnx.clone(model)
    for _, proj in list(_projections(model, LORA_TARGETS)):
        if getattr(proj, "lora_a", None) is None:
            continue
        kernel = proj.kernel[...].astype(jnp.float32)
        proj.kernel.set_value(kernel + delta(proj))
        del proj.lora_a, proj.lora_b, proj.lora_scale
    for _, variable in nnx.iter_graph(model):  # a bf16 base: float32 like the merged kernels
        if isinstance(variable, nnx.Param):
            variable.set_value(variable[...].astype(jnp.float32))
    return model
