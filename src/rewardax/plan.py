"""`rewardax plan`: whether a training job fits a TPU slice, answered on any machine.

libtpu describes the chips of a TPU slice without the chips (``jax.experimental.topologies``). The
job's own train step (``steps.jit_train_step`` over the model the run would build, the sharding
table, the optimizer and a batch of the run's shape) is lowered and compiled for those chips, and
XLA's memory analysis says what one chip holds: arguments (parameters, optimizer state, batch),
temporaries (activations, gradients, XLA's scratch), outputs, minus the donated buffers the outputs
reuse. Nothing runs and no weights are read: a directory holding only a ``config.json`` is enough
(``configs/shapes/``).

What is planned: padded batches of ``data.max_sequence_length`` tokens per response, the largest
shape the loader can make (packed layouts make no larger rows), ``train.per_device_train_batch_size``
pairs per data-parallel device and ``gradient_accumulation_steps`` microbatches per step; the
``model`` section (dtypes, remat, kernels chosen for a TPU) and the ``mesh`` section as
``rewardax train`` would use them on that slice.

HBM limits per chip (``TPU_HBM_GIB``): v5e 15.75 GiB (read on a v5e chip), v6e 31.25 GiB
(33,550,237,696 bytes, read on a v6e chip by vLLM's usage stats), v5p 95 GB and v4 32 GiB (the
spec sheets'; what the runtime leaves to a program there was not read).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rewardax import data as rdata
from rewardax import distributed
from rewardax.config import RewardConfig
from rewardax.errors import ConfigError, RewardaxError
from rewardax.losses import SCORE_LOSSES
from rewardax.models import lora
from rewardax.models.auto import read_architecture
from rewardax.models.config import ModelConfig
from rewardax.models.kernels import (
    compute_dtype,
    halvings_past_fit,
    remat_candidates,
    select_kernels,
)
from rewardax.models.loading import ModelOptions
from rewardax.models.transformer import remat_fallback
from rewardax.optim import build_optimizer, build_schedule
from rewardax.sharding import (
    HOST_MEMORY,
    batch_sharding,
    make_mesh,
    on_host,
    optimizer_state_shardings,
    replicated,
    state_shardings,
)
from rewardax.steps import configured_train_step, jit_train_step

GIB = 2**30
TPU_HBM_GIB = {
    "TPU v5 lite": 15.75,
    "TPU v6 lite": 33_550_237_696 / GIB,
    "TPU v5": 95e9 / GIB,
    "TPU v4": 32.0,
}
# Chips one host drives (x, y, z), by generation: a slice smaller than a host is one host.
_HOST_CHIPS = {"v5e": (2, 4, 1), "v6e": (2, 4, 1), "v5p": (2, 2, 1), "v4": (2, 2, 1)}
_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")
TOPOLOGY_EXAMPLES = "v5e:1x1, v5e:2x4, v5e:4x4, v5p:2x2x1, v6e:2x2"
# Without these, libtpu asks a cloud metadata server what machine it is on and prints a page of
# warnings when there is none, and holds /tmp/libtpu_lockfile so that a second plan would fail;
# plan describes a slice it is not on and drives no chip.
_QUIET_LIBTPU = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
}


class PlanError(RewardaxError):
    """The slice cannot be described or the step cannot be compiled for it."""


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-chip bytes of one compiled program (``jax.stages.Compiled.memory_analysis()``)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    host: int
    # True when libtpu refused the program (its temporaries alone exceed the chip): temporaries
    # come from its message (to 0.01 GiB) and the arguments from their shard shapes.
    estimated: bool = False

    @property
    def hbm(self) -> int:
        """What one chip holds at the peak: arguments + outputs - the outputs written into
        donated arguments + temporaries (the figure the chip runs measured, benchmarks/)."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def bytes(self) -> dict[str, int]:
        fields = dataclasses.asdict(self)
        del fields["estimated"]
        return fields | {"total": self.hbm}

    def gib(self) -> dict[str, float]:
        return {k: round(v / GIB, 3) for k, v in self.bytes().items()}


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One configuration compiled for the slice."""

    settings: tuple[str, ...]  # the overrides on top of the job's config ("" for the job itself)
    memory: Memory
    compile_s: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan` found: the slice, the job's shape, its memory per chip, and alternatives."""

    topology: str
    device_kind: str
    devices: int
    processes: int
    mesh: dict[str, int]
    model: str
    parameters: int
    pairs_per_step: int
    tokens_per_step: int
    model_flops_per_step: float
    hbm_limit_gib: float
    job: Compiled
    suggestions: tuple[Compiled, ...]
    suggestions_tried: bool = False
    # `auto` settings and what they became for this slice ("model.remat_policy": "full"), with
    # the memory of each remat policy tried.
    resolved: dict[str, str] = dataclasses.field(default_factory=dict)
    remat_tried: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.job.memory.hbm <= self.hbm_limit_gib * GIB

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology,
            "device_kind": self.device_kind,
            "devices": self.devices,
            "processes": self.processes,
            "mesh": self.mesh,
            "model": self.model,
            "parameters": self.parameters,
            "pairs_per_step": self.pairs_per_step,
            "tokens_per_step": self.tokens_per_step,
            "model_flops_per_step": self.model_flops_per_step,
            "fits": self.fits,
            "hbm_per_chip_gib": round(self.job.memory.hbm / GIB, 3),
            "hbm_limit_gib": round(self.hbm_limit_gib, 3),
            "hbm_gib": self.job.memory.gib(),
            "hbm_bytes": self.job.memory.bytes(),
            "hbm_estimated": self.job.memory.estimated,
            "compile_s": round(self.job.compile_s, 1),
            "resolved": self.resolved,
            "remat_tried": list(self.remat_tried),
            "suggestions": [
                {
                    "settings": list(s.settings),
                    "hbm_per_chip_gib": round(s.memory.hbm / GIB, 3),
                    "hbm_estimated": s.memory.estimated,
                    "fits": s.memory.hbm <= self.hbm_limit_gib * GIB,
                }
                for s in self.suggestions
            ],
        }


def topology_devices(name: str) -> list[Any]:
    """The devices of TPU slice ``name`` ("v5e:2x4"), described by libtpu without the chips.

    Raises:
      PlanError: libtpu is not installed, or ``name`` is not a slice it knows.
    """
    match = _TOPOLOGY.match(name)
    if match is None:
        raise PlanError(
            f"topology {name!r}: use GENERATION:XxY[xZ] with a generation among "
            f"{', '.join(_HOST_CHIPS)} (e.g. {TOPOLOGY_EXAMPLES})"
        )
    try:
        import libtpu  # noqa: F401
    except ImportError as exc:
        raise PlanError(
            "rewardax plan compiles for a TPU with libtpu, which is not installed: pip install "
            "'rewardax[tpu]' (no TPU is needed, libtpu describes the slice)"
        ) from exc
    from jax.experimental import topologies

    for key, value in _QUIET_LIBTPU.items():
        os.environ.setdefault(key, value)
    generation = match.group(1)
    dims = tuple(int(d) for d in match.groups()[1:] if d is not None)
    dims3 = (*dims, 1) if len(dims) == 2 else dims
    host = tuple(min(d, h) for d, h in zip(dims3, _HOST_CHIPS[generation], strict=True))
    try:
        description = topologies.get_topology_desc(
            platform="tpu", topology_name=name, chips_per_host_bounds=host
        )
    except Exception as exc:  # libtpu's XlaRuntimeError: an impossible layout
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PlanError(
            f"topology {name!r} is not a TPU slice libtpu can describe ({first}); slices "
            f"look like {TOPOLOGY_EXAMPLES}"
        ) from exc
    return list(description.devices)


def model_flops_per_token(
    arch: ModelConfig, params: int, embedding: int, length: int, *, frozen: bool = False
) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters (forward and backward matmuls; 4 x
    with a frozen base, whose weight gradients are not computed) + 12 x layers x hidden x length
    (attention scores and values, forward and backward, without the causal half saved); remat's
    recomputation is not counted (the MFU of benchmarks/)."""
    per_param = 4.0 if frozen else 6.0
    attention = 12.0 * arch.num_hidden_layers * arch.hidden_size * length
    return per_param * (params - embedding) + attention


def _abstract_state(
    config: RewardConfig, arch: ModelConfig, mesh: Any, optimizer: Any, backend: str
):
    """(graphdef, every parameter, abstract arrays with their shardings, the shardings): shapes
    only, no memory is used."""
    options = ModelOptions.from_section(config.model, seed=config.train.seed)
    options = options.replace(kernels=select_kernels(config.model.kernels, backend))
    model = nnx.eval_shape(lambda: lora.add_configured_adapters(options.build(arch), config.model))
    everything = nnx.state(model, nnx.Param)  # counted for FLOPs, LoRA's frozen base included
    graphdef, params, rest = lora.split(model)
    param_shardings = state_shardings(params, mesh)
    if config.optim.offload_params:
        param_shardings = on_host(param_shardings)
    shardings = {
        "params": param_shardings,
        "rest": state_shardings(rest, mesh),
        "opt_state": optimizer_state_shardings(
            optimizer, params, mesh, offload=config.optim.offload_state
        ),
        "step": replicated(mesh),
        "rng": replicated(mesh),
    }
    values = {
        "params": params,
        "rest": rest,
        "opt_state": jax.eval_shape(optimizer.init, params),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
    }
    arrays = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), values, shardings
    )
    return graphdef, everything, arrays, shardings


# K planned for a group loss (train.loss other than bradley_terry) when train.max_responses is
# not set: K comes from the data, which planning does not read.
PLANNED_RESPONSES = 4


def _batch(
    pairs: int, length: int, sharding: Any, config: RewardConfig | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """The padded batch's shapes and dtypes (those of the loader's batches), split as the trainer
    splits it. With a group loss, a group batch of `pairs` rows of K responses
    (`rewardax.data.groups`; K = train.max_responses, else `PLANNED_RESPONSES`)."""
    loss = "bradley_terry" if config is None else config.train.loss
    if loss == "bradley_terry":
        batch = distributed.padding_batch(pairs, length, rdata.BATCH_KEYS)
    else:
        k = 1 if loss in SCORE_LOSSES else (config.train.max_responses or PLANNED_RESPONSES)
        target = "scores" if loss in SCORE_LOSSES else "ranks"
        objectives = len(config.model.objectives or ()) if loss in SCORE_LOSSES else 0
        batch = rdata.collate_groups([], 0, [length], pairs, k, target, objectives)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in batch.items()}


@dataclasses.dataclass
class _Job:
    """One configuration laid out on the slice, ready to compile."""

    config: RewardConfig
    arch: ModelConfig
    mesh: Any
    pairs: int
    params: Any
    compile_args: tuple
    step: Any


def _lay_out(config: RewardConfig, arch: ModelConfig, devices: list[Any]) -> _Job:
    processes = len({d.process_index for d in devices})
    config.validate(num_devices=len(devices), num_processes=processes)
    dp, fsdp, tp = config.mesh.resolve(len(devices))
    mesh = make_mesh(dp, fsdp, tp, devices)
    train = config.train
    pairs = train.per_device_train_batch_size * dp * fsdp * train.gradient_accumulation_steps
    total_steps = int(train.max_training_steps or 1000)  # the schedule's length: no memory
    optimizer = build_optimizer(config.optim, total_steps)
    backend = devices[0].platform
    graphdef, params, arrays, shardings = _abstract_state(config, arch, mesh, optimizer, backend)
    schedule = build_schedule(config.optim, total_steps)
    dropout = config.model.dropout_rate > 0
    step = configured_train_step(config, graphdef, optimizer, schedule, dropout=dropout)
    batch = _batch(pairs, config.data.max_sequence_length, batch_sharding(mesh), config)
    jitted = jit_train_step(step, shardings, mesh)
    return _Job(config, arch, mesh, pairs, params, (arrays, batch), jitted)


# What libtpu says when the temporaries alone exceed the chip (it refuses to compile then).
_OUT_OF_HBM = re.compile(r"memory required for HLO temporaries \((\d+(?:\.\d+)?)G\)")


def _argument_bytes(arrays: Any) -> tuple[int, int]:
    """Bytes one chip (device memory) and its host hold of the abstract arguments' shards."""
    device = host = 0
    for leaf in jax.tree.leaves(arrays):
        shard = leaf.sharding.shard_shape(leaf.shape)
        size = math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
        if leaf.sharding.memory_kind == HOST_MEMORY:
            host += size
        else:
            device += size
    return device, host


def _compile(job: _Job, settings: tuple[str, ...]) -> Compiled:
    start = time.perf_counter()
    try:
        compiled = job.step.lower(*job.compile_args).compile()
    except RewardaxError:
        raise
    except Exception as exc:
        found = _OUT_OF_HBM.search(str(exc))
        if found:
            # The program is known up to its layout: the temporaries from the compiler's own
            # message, the arguments (the state, donated and written in place) from their shards.
            arguments, host = _argument_bytes(job.compile_args)
            temporaries = int(float(found.group(1)) * GIB)
            memory = Memory(arguments, arguments, arguments, temporaries, host, estimated=True)
            return Compiled(settings, memory, time.perf_counter() - start)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PlanError(f"XLA could not compile the train step for this slice: {first}") from exc
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    memory = Memory(
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        aliased=m.alias_size_in_bytes,
        temporaries=m.temp_size_in_bytes,
        host=m.host_argument_size_in_bytes
        + m.host_output_size_in_bytes
        - m.host_alias_size_in_bytes
        + m.host_temp_size_in_bytes,
    )
    # Not XLA's cost_analysis() FLOPs: it counts the body of the layers' loop once.
    return Compiled(settings, memory, seconds)


def memory_limit(device: Any) -> int | None:
    """Bytes a program may hold on ``device``: the TPU table's figure (`TPU_HBM_GIB`; a chip
    described by libtpu has no runtime to ask), else the runtime's ``bytes_limit``, else None
    (the CPU, where the step's memory is the host's)."""
    if device.device_kind in TPU_HBM_GIB:
        return int(TPU_HBM_GIB[device.device_kind] * GIB)
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some runtimes have no statistics
        stats = {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


# Left free under the device's limit when `auto` picks a remat policy: the prefetched batches and
# the runtime's own buffers live beside the train step (the chip ran steps of 15.44 of 15.75 GiB).
REMAT_HEADROOM = 128 * 2**20


# `auto` splits a device's pairs into microbatches (gradient accumulation) only down to this many
# tokens per microbatch. On the v5e (benchmarks/results/tpu_v5e_2026-12-07d_accumulate.md)
# Qwen2.5-0.5B at 16 x 512 with save_attention_mlp ran at 51.0% MFU on 2 pairs x 8 (2048 tokens),
# 49.8% on 4 x 4 and 45.9% on 1 x 16 (1024 tokens); earlier (2026-12-06 sixth session) less remat
# on smaller microbatches won down to 4k tokens: 0.5B at 8 x 2048, save_attention on 1 pair x 8
# 47.6% against full on the 8 pairs 38.2%.
MIN_MICROBATCH_TOKENS = 2048
# ... and into at most this many (each split is one more compilation at start).
MAX_MICROBATCHES = 8


def _splits(config: RewardConfig, policy: str) -> list[int]:
    """Microbatches per step to try with ``policy``, fewest first: 1, then halvings of the pairs
    per device (the same pairs per update), for a padded layout without accumulation of its own;
    at most `MAX_MICROBATCHES`; with "full" down to one pair (the last resort before not fitting),
    else while a microbatch keeps `MIN_MICROBATCH_TOKENS`."""
    pairs, splits = config.train.per_device_train_batch_size, [1]
    if config.data.layout != "padded" or config.train.gradient_accumulation_steps != 1:
        return splits
    tokens_per_pair = 2 * config.data.max_sequence_length
    a = 2
    while (
        a <= MAX_MICROBATCHES
        and pairs % a == 0
        and (policy == "full" or (pairs // a) * tokens_per_pair >= MIN_MICROBATCH_TOKENS)
    ):
        splits.append(a)
        a *= 2
    return splits


def choose_remat(
    config: RewardConfig, arch: ModelConfig, devices: list[Any], limit: int
) -> tuple[str, int, tuple[str, ...]]:
    """The fastest (remat policy, microbatches) whose train step, compiled for ``devices``, needs
    at most ``limit`` - `REMAT_HEADROOM` bytes per device: policies in `kernels.remat_candidates`
    order (less recomputation first), each with the whole batch, then halved microbatches
    (`_splits`); once one fits, `kernels.halvings_past_fit` more halvings (each compiled, kept
    if it fits). On the v5e less remat on smaller microbatches beat more remat on the whole
    batch (SmolLM2, 2048 tokens: save_attention on 4 pairs x 4 36.8% MFU, full on 16: 25.3%;
    Qwen2.5-0.5B: save_attention on 1 pair x 8 47.6%, full on 8: 38.2%). ("full", 1) when
    nothing fits (the run then fails to allocate; `rewardax plan` suggests what else to change).
    Returns (policy, microbatches, "what: GiB" for each one compiled)."""
    kernels = select_kernels(config.model.kernels, devices[0].platform)
    pairs = config.train.per_device_train_batch_size
    tried: list[str] = []

    def fits(policy: str, split: int) -> bool:
        candidate = config.model_copy(deep=True)
        candidate.model.remat_policy = policy
        if split > 1:  # `_splits` offers these only without an accumulation of its own
            candidate.train.per_device_train_batch_size = pairs // split
            candidate.train.gradient_accumulation_steps = split
        memory = _compile(_lay_out(candidate, arch, devices), ()).memory
        what = policy if split == 1 else f"{policy} ({pairs // split} pairs x {split})"
        tried.append(f"{what}: {memory.hbm / GIB:.2f} GiB")
        return memory.hbm <= limit - REMAT_HEADROOM

    for policy in remat_candidates(kernels):
        splits = _splits(config, policy)
        for i, split in enumerate(splits):
            if fits(policy, split):
                for smaller in splits[i + 1 : i + 1 + halvings_past_fit(kernels, policy)]:
                    if not fits(policy, smaller):
                        break
                    split = smaller
                return policy, split, tuple(tried)
    return "full", 1, tuple(tried)


def resolve_auto(
    config: RewardConfig, arch: ModelConfig | None, devices: list[Any]
) -> tuple[RewardConfig, dict[str, str], tuple[str, ...]]:
    """``config`` with its `auto` model settings decided for ``devices`` (a copy; ``config`` is
    not changed): ``model.dtype`` by backend (`kernels.compute_dtype`) and
    ``model.remat_policy`` (with the pairs per device split into microbatches when that is
    faster) by compiling the train step (`choose_remat`; "none" on a CPU, whose
    memory is the host's, or without ``arch``). Returns (config, {setting: value chosen}, remat
    policies tried)."""
    backend = devices[0].platform
    config = config.model_copy(deep=True)
    resolved: dict[str, str] = {}
    tried: tuple[str, ...] = ()
    if config.model.dtype == "auto":
        config.model.dtype = resolved["model.dtype"] = compute_dtype("auto", backend)
    if config.model.remat_policy == "auto":
        limit = memory_limit(devices[0])
        if limit is None or arch is None:
            policy = "none"
        else:
            policy, split, tried = choose_remat(config, arch, devices, limit)
            if split > 1:  # the same pairs per update, in `split` microbatches
                pairs = config.train.per_device_train_batch_size // split
                config.train.per_device_train_batch_size = pairs
                config.train.gradient_accumulation_steps = split
                resolved["train.per_device_train_batch_size"] = str(pairs)
                resolved["train.gradient_accumulation_steps"] = str(split)
        config.model.remat_policy = resolved["model.remat_policy"] = policy
    return config, resolved, tried


def _same_auto(other: RewardConfig, resolved: RewardConfig) -> RewardConfig:
    """``other`` (a suggestion's config) with the `auto` settings it still has decided as in
    ``resolved`` (the job's)."""
    other = other.model_copy(deep=True)
    for name in ("dtype", "remat_policy"):
        if getattr(other.model, name) == "auto":
            setattr(other.model, name, getattr(resolved.model, name))
    return other


def alternatives(config: RewardConfig, devices: int) -> list[tuple[str, ...]]:
    """Settings that lower a job's memory per chip, one change each, the cheapest in speed first:
    remat of every block; once remat is `full`, the splash attention kernel's residuals kept in
    host memory instead (`offload_attention`: 2-3% less HBM than `full` with splash, for steps
    1.12-1.46x `full`'s on a v5e chip, benchmarks/results/tpu_v5e_2026-12-06c_offload_attention.md,
    so never offered over `full`; only where splash runs the attention); the data-parallel devices turned into fsdp (parameters and optimizer
    state split across them), the optimizer state in host memory, the float32 parameters there
    too (a bfloat16 copy on the chip), bfloat16 parameters and moments, LoRA of rank 16 on a
    bfloat16 base, half the pairs per device with twice the accumulation (the same pairs per
    update)."""
    out: list[tuple[str, ...]] = []
    if config.model.remat_policy not in ("full", "offload_attention"):
        out.append(("model.remat_policy=full",))
    # Only a splash kernel names residuals to offload, and with rewardax's flash kernels
    # (`Kernels.flash`, a TPU's padded and packed rows) offloading needed more device memory
    # than `full` (`kernels`' docstring): offered where splash runs the attention.
    kernels = select_kernels(config.model.kernels, "tpu")
    splash = kernels.flash is None or config.data.layout == "shared_prompt"
    no_offload = remat_fallback("offload_attention", kernels)
    if no_offload is None and splash and config.model.remat_policy == "full":
        out.append(("model.remat_policy=offload_attention",))
    dp, _, tp = config.mesh.resolve(devices)
    if dp > 1:
        out.append(("mesh.dp=1", "mesh.fsdp=-1", f"mesh.tp={tp}"))
    if not config.optim.offload_state:
        out.append(("optim.offload_state=true",))
    mixed = config.model.dtype == "bfloat16" and config.model.param_dtype == "float32"
    if mixed and config.optim.name == "adamw" and not config.optim.offload_params:
        out.append(("optim.offload_state=true", "optim.offload_params=true"))
    if jnp.dtype(config.model.param_dtype) != jnp.bfloat16:
        out.append(("model.param_dtype=bfloat16",))
    if config.model.lora_rank == 0 and not config.optim.offload_params:
        out.append(("model.lora_rank=16", "model.param_dtype=bfloat16"))
    per_device = config.train.per_device_train_batch_size
    if per_device > 1:
        out.append(
            (
                f"train.per_device_train_batch_size={per_device // 2}",
                f"train.gradient_accumulation_steps={config.train.gradient_accumulation_steps * 2}",
            )
        )
    return out


def plan(
    config: RewardConfig,
    topology: str,
    *,
    overrides: list[str] | None = None,
    suggest: bool = True,
    rebuild: Any = None,
) -> Plan:
    """Compiles ``config``'s train step for the slice ``topology`` and measures it per chip.

    Args:
      config: the job (``model.path`` is read for its architecture only).
      topology: a TPU slice, e.g. "v5e:2x4".
      overrides: the ``--section.key=value`` settings ``config`` was built with; suggestions add
        theirs after them.
      suggest: when the job does not fit, also compile `alternatives` (one at a time, then all
        together) and report which fit.
      rebuild: ``f(overrides) -> RewardConfig`` used for the alternatives (the CLI passes its
        YAML + overrides parser); None: suggestions are not compiled.
    """
    devices = topology_devices(topology)
    kind = devices[0].device_kind
    if kind not in TPU_HBM_GIB:
        raise PlanError(f"no HBM figure for {kind!r} chips; known: {', '.join(TPU_HBM_GIB)}")
    if not config.model.path:
        raise ConfigError(
            "plan needs model.path: a model directory, a .gguf file, or a directory holding only "
            "a config.json (configs/shapes/ has Qwen2.5 and Llama-3.1 shapes)"
        )
    arch = read_architecture(config.model.path)
    config, resolved, remat_tried = resolve_auto(config, arch, devices)
    job = _lay_out(config, arch, devices)
    compiled = _compile(job, ())
    limit = TPU_HBM_GIB[kind]
    suggestions: list[Compiled] = []
    tried_any = suggest and rebuild is not None and compiled.memory.hbm > limit * GIB
    if tried_any:
        changes = alternatives(config, len(devices))
        # Then the full fine-tuning savers together (offload and LoRA exclude each other; the
        # offloaded attention residuals are a remat policy, as `full` is).
        on_chip = [c for c in changes if not any("offload" in x or "lora" in x for x in c)]
        together = tuple(x for change in on_chip for x in change)
        for change in dict.fromkeys([*changes, together] if len(on_chip) > 1 else changes):
            try:
                other = _same_auto(rebuild([*(overrides or []), *change]), config)
                suggestions.append(_compile(_lay_out(other, arch, devices), change))
            except ConfigError:
                continue  # a combination the job's other settings rule out
    leaves = jax.tree.leaves(job.params)
    parameters = sum(math.prod(x.shape) for x in leaves)
    embedding = arch.vocab_size * arch.hidden_size
    length = config.data.max_sequence_length
    tokens = job.pairs * 2 * length
    dp, fsdp, tp = job.mesh.devices.shape
    return Plan(
        topology=topology,
        device_kind=kind,
        devices=len(devices),
        processes=len({d.process_index for d in devices}),
        mesh={"dp": dp, "fsdp": fsdp, "tp": tp},
        model=str(config.model.path),
        parameters=parameters,
        pairs_per_step=job.pairs,
        tokens_per_step=tokens,
        model_flops_per_step=tokens
        * model_flops_per_token(
            arch, parameters, embedding, length, frozen=config.model.lora_rank > 0
        ),
        hbm_limit_gib=limit,
        job=compiled,
        suggestions=tuple(suggestions),
        suggestions_tried=tried_any,
        resolved=resolved,
        remat_tried=remat_tried,
    )


def describe(result: Plan) -> str:
    """The plan in a few lines for a person (the CLI prints it before its JSON line)."""
    d = result.to_dict()
    h = d["hbm_gib"]
    mesh = "x".join(f"{k}{v}" for k, v in result.mesh.items())
    verdict = "fits" if result.fits else "does NOT fit"
    lines = [
        f"{result.model} on {result.topology} ({result.devices} x {result.device_kind}, "
        f"{result.processes} host(s), mesh {mesh}): {result.parameters / 1e9:.2f}B parameters, "
        f"{result.pairs_per_step} pairs x 2 x {result.tokens_per_step // result.pairs_per_step // 2}"
        f" tokens per step",
        f"HBM per chip: {h['total']:.2f} GiB of {result.hbm_limit_gib:.2f} -> {verdict}"
        + (" (libtpu refused it: temporaries from its message)" if d["hbm_estimated"] else "")
        + " "
        f"(arguments {h['arguments']:.2f}, temporaries {h['temporaries']:.2f}, outputs "
        f"{h['outputs']:.2f}, aliased {h['aliased']:.2f}, host {h['host']:.2f})",
        f"model FLOPs per step {result.model_flops_per_step:.3e} "
        f"({result.model_flops_per_step / result.devices:.3e} per chip; 6 x non-embedding "
        "parameters + attention, per token, remat recomputation not counted)",
    ]
    if result.resolved:
        chosen = ", ".join(f"{k}={v}" for k, v in result.resolved.items())
        tried = f" (remat tried: {'; '.join(result.remat_tried)})" if result.remat_tried else ""
        lines.append(f"auto settings: {chosen}{tried}")
    for s in result.suggestions:
        gib = s.memory.hbm / GIB
        mark = "fits" if gib <= result.hbm_limit_gib else "does not fit"
        lines.append(f"  with --{' --'.join(s.settings)}: {gib:.2f} GiB per chip, {mark}")
    if result.suggestions_tried and not result.suggestions:
        lines.append(
            "  no setting among remat, fsdp, offload, bf16 state, LoRA, smaller batches applies"
        )
    return "\n".join(lines)
