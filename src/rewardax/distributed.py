"""Multi-process runs on JAX's own runtime: `jax.distributed` plus the few cross-process helpers
the trainer needs.

rewardax is multi-controller SPMD: every process runs the same program over a global mesh, reads its
own slice of the data and hands JAX its share of each batch. Nothing here talks to the network
itself; collectives go through `jax.experimental.multihost_utils` (NCCL/ICI on accelerators, gloo
on CPU).

    import rewardax as rx
    from rewardax.distributed import initialize
    config = rx.RewardConfig.from_yaml("job.yaml")
    initialize(config)              # before any JAX computation (model loading included)
    trainer = rx.RewardTrainer(config, tok, train_dataset="train.jsonl")
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from rewardax.config import DistributedSection, RewardConfig
from rewardax.errors import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # also read by jax.distributed itself
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the job (returned by :func:`initialize`)."""

    process_index: int
    process_count: int
    local_device_count: int
    device_count: int


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None


def _cluster_says_multiprocess() -> bool:
    """A multi-process launch by a scheduler JAX knows how to read (cheap checks only: the TPU
    metadata server is not queried; use `distributed.initialize=on` there if this misses it)."""
    slurm = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODELIST")
    if all(k in os.environ for k in slurm) and (_env_int("SLURM_NTASKS") or 1) > 1:
        return True
    if "OMPI_MCA_orte_hnp_uri" in os.environ and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return True
    hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES")
    return bool(hosts and "," in hosts)


def _settings(config: RewardConfig | DistributedSection | None) -> DistributedSection:
    if config is None:
        return DistributedSection()
    if isinstance(config, RewardConfig):
        return config.distributed
    if isinstance(config, DistributedSection):
        return config
    raise ConfigError(
        f"initialize() takes a RewardConfig or its distributed section, not {type(config).__name__}"
    )


def initialize(config: RewardConfig | DistributedSection | None = None) -> ProcessInfo:
    """Joins this process to a multi-process job (`jax.distributed.initialize`) when configured.

    Call it first, before anything runs on a device (building or loading a model does): JAX fixes
    the device set at its first computation. `RewardTrainer` calls it too, which is enough when the
    trainer loads the model itself (`rewardax train` does). Calling it again is a no-op.

    Settings come from `config.distributed`, then the environment (`JAX_COORDINATOR_ADDRESS`,
    `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), then JAX's own cluster detection (SLURM, Open MPI,
    Cloud TPU, Kubernetes) for whatever is still unset.

    Returns:
      ProcessInfo(process_index, process_count, local_device_count, device_count).

    Raises:
      ConfigError: multi-process settings given but JAX already started single-process, or
        jax.distributed could not be initialized (the message says which value to set).
    """
    settings = _settings(config)
    if settings.initialize != "off" and not jax.distributed.is_initialized():
        coordinator = settings.coordinator_address or os.environ.get(ENV_COORDINATOR) or None
        num_processes = settings.num_processes
        if num_processes is None:
            num_processes = _env_int(ENV_NUM_PROCESSES)
        process_id = settings.process_id
        if process_id is None:
            process_id = _env_int(ENV_PROCESS_ID)
        wanted = settings.initialize == "on" or (
            coordinator is not None
            or (num_processes is not None and num_processes > 1)
            or _cluster_says_multiprocess()
        )
        single = num_processes == 1 and settings.initialize != "on"
        if wanted and not single:
            _start(coordinator, num_processes, process_id)
    return ProcessInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
    )


def _start(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    from jax._src import xla_bridge  # no public "has JAX started?" query exists

    if xla_bridge.backends_are_initialized():
        raise ConfigError(
            "multi-process settings were found (distributed.* or JAX_COORDINATOR_ADDRESS / a "
            "SLURM, MPI or TPU-pod launch) but JAX already started in single-process mode; call "
            "rewardax.distributed.initialize(config) first, before building or loading the "
            "model, or set distributed.initialize=off"
        )
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
    except (ValueError, TypeError) as error:
        raise ConfigError(
            f"jax.distributed.initialize failed: {error}. Set distributed.coordinator_address "
            "(host:port of process 0), distributed.num_processes and distributed.process_id, or "
            f"the environment variables {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}"
        ) from None


# ---- cross-process helpers (each a no-op on a single process) ---------------------------------


def allgather(x: np.ndarray | float | int) -> np.ndarray:
    """Stacks `x` from every process along a new leading axis: [process_count, *x.shape].

    Every process must call it with the same shape and dtype, at the same point of the program.
    """
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def agree_max(value: int) -> int:
    """The largest `value` over all processes (e.g. the sequence length of a global batch)."""
    return int(allgather(np.int64(value)).max())


def process_sum(value: float) -> float:
    """The sum of `value` over all processes."""
    return float(allgather(np.float64(value)).sum())


def gather_json(obj: Any) -> list[Any]:
    """`obj` (JSON-serialisable) from every process, in process order (e.g. data-iterator states)."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), dtype=np.uint8)
    size = agree_max(data.size)
    padded = np.zeros(size, np.uint8)
    padded[: data.size] = data
    lengths = allgather(np.int64(data.size))
    rows = allgather(padded)
    return [json.loads(rows[i, : lengths[i]].tobytes()) for i in range(len(rows))]


def gather_to_host(tree: Any) -> Any:
    """Every array of `tree` as a full numpy array on every process (sharded ones are gathered).

    Collective on multi-process runs: all processes must call it.
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def pad_to_length(batch: dict[str, np.ndarray], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Pads the token axis of a collated batch to `length` (input_ids with `pad_id`, masks with 0).

    Processes bucket their own rows, so their batches may differ in length T; a global array needs
    one shape. Padding positions have attention_mask 0 and the reward is read at `reward_index`,
    so the result does not change.

    Args:
      batch: input_ids / attention_mask [B, 2, T] and per-pair arrays [B] / [B, 2].
      length: the target T (>= the batch's own).
    """
    t = batch["input_ids"].shape[-1]
    if length == t:
        return batch
    if length < t:
        raise ValueError(f"cannot pad a batch of length {t} down to {length}")
    out = dict(batch)
    for key, fill in (("input_ids", pad_id), ("attention_mask", 0)):
        x = batch[key]
        widths = [(0, 0)] * (x.ndim - 1) + [(0, length - t)]
        out[key] = np.pad(x, widths, constant_values=fill)
    return out


_BATCH_DTYPES = {
    "input_ids": np.int32,
    "attention_mask": np.int32,
    "reward_index": np.int32,
    "margin": np.float32,
    "pair_mask": np.float32,
    "row_index": np.int32,
}


def padding_batch(batch_size: int, length: int, keys: Iterable[str]) -> dict[str, np.ndarray]:
    """A batch of padding pairs only (pair_mask 0, row_index -1): input_ids / attention_mask
    [B, 2, T], reward_index [B, 2], margin / pair_mask / row_index [B]."""
    shapes = {"input_ids": (batch_size, 2, length), "attention_mask": (batch_size, 2, length)}
    shapes["reward_index"] = (batch_size, 2)
    out = {}
    for key in keys:
        fill = -1 if key == "row_index" else 0
        out[key] = np.full(shapes.get(key, (batch_size,)), fill, dtype=_BATCH_DTYPES[key])
    if "attention_mask" in out:
        out["attention_mask"][..., 0] = 1  # one attended token: no all-masked softmax row
    return out


def lockstep(
    batches: Iterable[dict[str, np.ndarray]], pad_id: int
) -> Iterator[dict[str, np.ndarray]]:
    """This process's batches, made to fit one global batch per step on every process.

    Processes bucket their own rows, so their sequence lengths differ: each step they agree on the
    longest and pad to it. Their slices may also hold different numbers of batches (an eval set of
    37 rows on 2 processes): a process that has run out yields padding batches (pair_mask or
    row_mask 0) shaped as its batches, until all have. A process with no batch at all (fewer rows
    than processes) pads in the layout of another's first batch (pairs, or groups of K
    responses), exchanged once at the start. One small all-gather per step; nothing is exchanged
    on a single process.

    Args:
      batches: this process's batches (the loader's output; the same batch size on every
        process).
      pad_id: token id for padded positions.
    """
    iterator = iter(batches)
    batch = next(iterator, None)
    layouts = [x for x in gather_json(batch_layout(batch)) if x is not None]
    template = batch
    if template is None and layouts:
        template = {k: np.zeros(shape, dtype) for k, (shape, dtype) in layouts[0].items()}
    while True:
        length = 0 if batch is None else batch["input_ids"].shape[-1]
        status = allgather(np.asarray([batch is not None, length], np.int64))
        if not status[:, 0].any():
            return
        target = int(status[:, 1].max())
        if batch is None:
            batch = padding_like(template, target)
        yield pad_to_length(batch, target, pad_id)
        batch = next(iterator, None)
        if batch is not None:
            template = batch


def batch_layout(batch: dict[str, np.ndarray] | None) -> dict[str, list] | None:
    """A batch's keys with their shapes and dtypes, as JSON (`{key: [shape, dtype]}`); None for
    no batch."""
    if batch is None:
        return None
    return {k: [list(v.shape), v.dtype.str] for k, v in batch.items()}


def padding_like(batch: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """A batch of padding rows only, shaped as `batch` (pairs or groups of K responses) but
    `length` tokens long (the step's length, which may be shorter than `batch`'s): every mask 0
    but one attended token per sequence, row_index -1."""
    out = {}
    for key, value in batch.items():
        tokens = key in ("input_ids", "attention_mask")
        out[key] = np.zeros((*value.shape[:-1], length) if tokens else value.shape, value.dtype)
    out["attention_mask"][..., 0] = 1
    if "row_index" in out:
        out["row_index"][:] = -1
    return out


def local_row_indices(sharding: jax.sharding.Sharding, global_rows: int) -> np.ndarray:
    """The rows of a [global_rows, ...] array, sharded by `sharding` on axis 0, that this process
    supplies to `jax.make_array_from_process_local_data`, in the order of its local data.

    JAX maps the process's addressable slices, sorted, onto consecutive slices of its local data.
    """
    indices = sharding.addressable_devices_indices_map((global_rows,)).values()
    starts = sorted({(s[0].start or 0, s[0].stop or global_rows) for s in indices})
    return np.concatenate([np.arange(a, b) for a, b in starts]) if starts else np.arange(0)
