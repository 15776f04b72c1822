"""The device mesh and the ONE table that maps the models' logical axes to mesh axes.

Models name their parameters' axes logically (`embed`, `mlp`, `heads`, ...); nothing outside this file
mentions a mesh axis name. Mesh axes: `dp` (pure data parallel: parameters replicated), `fsdp` (data
parallel with parameters and optimizer state sharded), `tp` (tensor parallel inside each layer).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rewardax.errors import ConfigError

MESH_AXES = ("dp", "fsdp", "tp")

# Logical axis -> mesh axis (or None: not sharded). Weight matrices are split along `embed` by fsdp
# and along their head/MLP dimension by tp, as in Megatron-style tensor parallelism.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("dp", "fsdp"),
    "layers": None,  # the stacked axis of the scanned decoder layers
    "length": None,
    "embed": "fsdp",
    "vocab": "tp",
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "labels": None,
    "norm": None,
}


def make_mesh(dp: int, fsdp: int, tp: int, devices: list | None = None) -> Mesh:
    """A (dp, fsdp, tp) mesh over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    if dp * fsdp * tp != len(devices):
        raise ConfigError(
            f"mesh dp={dp} x fsdp={fsdp} x tp={tp} = {dp * fsdp * tp} devices, but "
            f"{len(devices)} are available; set mesh sizes whose product is {len(devices)} "
            "(use -1 for one axis to take the rest)"
        )
    return Mesh(np.asarray(devices).reshape(dp, fsdp, tp), MESH_AXES)


def logical_to_mesh_spec(
    logical: tuple | None, shape: tuple[int, ...], mesh: Mesh
) -> PartitionSpec:
    """Translates a tuple of logical axis names into a PartitionSpec for `mesh`.

    A dimension whose size is not divisible by its mesh axes' size stays replicated (small
    configurations, e.g. 2 kv heads on tp=4), so any model runs on any mesh.
    """
    if not logical:
        return PartitionSpec()
    used: set[str] = set()
    spec = []
    for name, size in zip(logical, shape, strict=True):
        target = LOGICAL_AXIS_RULES.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or size % n:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _logical_axes(variable: nnx.Variable) -> tuple | None:
    metadata = variable.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        value = metadata.get(key)
        if value:
            return tuple(value)
    return None


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """NamedShardings for an `nnx.State` (parameters) from its variables' logical axis names."""

    def one(x):
        if isinstance(x, nnx.Variable):
            value = x.get_value() if hasattr(x, "get_value") else x.value
            spec = logical_to_mesh_spec(_logical_axes(x), tuple(value.shape), mesh)
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_state_shardings(
    optimizer: Any, params: Any, mesh: Mesh, *, offload: bool = False
) -> Any:
    """NamedShardings for `optimizer.init(params)`: moments follow their parameter's logical axes.

    Optax builds Adam's `mu`/`nu` by mapping over the parameter `nnx.State`, so they keep each
    parameter's `out_sharding` metadata; scalars (step counts) are replicated. Left to `jax.jit`
    alone, `optimizer.init`'s zeros are not tied to the parameters and land unsharded. With
    ``offload`` they live in host memory (``pinned_host``), split the same way.
    """
    shardings = state_shardings(jax.eval_shape(optimizer.init, params), mesh)
    return on_host(shardings) if offload else shardings


def on_host(shardings: Any) -> Any:
    """The same splits, in host memory (`HOST_MEMORY`)."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


# Where offloaded arrays live between steps: host memory the accelerator can copy from directly.
HOST_MEMORY = "pinned_host"


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are split over the data-parallel axes along their first (pair) dimension."""
    return NamedSharding(mesh, PartitionSpec(LOGICAL_AXIS_RULES["batch"]))


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's slice of a batch -> global arrays split over the data-parallel axes.

    Args:
      local_batch: arrays [B_local, ...] (B_local = global batch / process_count); on one process
        this is the whole batch.

    Returns:
      jax.Arrays [B_local * process_count, ...] with `batch_sharding(mesh)`; every process must
      pass arrays of the same shapes (see `rewardax.distributed.pad_to_length`).
    """
    sharding = batch_sharding(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
        for k, v in local_batch.items()
    }


def bytes_per_device(tree: Any) -> dict[Any, int]:
    """Bytes each local device holds for the arrays of `tree` (measured from their shards)."""
    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals


def traced_in_mesh(fn: Any, mesh: Mesh) -> Any:
    """``fn`` traced with ``mesh`` as the context's (abstract) mesh, for what inside needs to
    know how its inputs are split: Pallas kernels cannot be partitioned by XLA and run per shard
    under ``shard_map`` over this mesh (``models.pallas_attention``). Wrap before ``jax.jit``."""

    def in_mesh(*args: Any, **kwargs: Any) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return in_mesh


def replicated(mesh: Mesh) -> NamedSharding:
    """The same full array on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())
