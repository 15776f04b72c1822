"""RewardTrainer: the reference API (EasyDeL's `RewardTrainer` docs) over a generic loop.

`rewardax.loop.Loop` runs the jitted step of `rewardax.steps` and knows nothing about preferences;
the trainer assembles it: model and optimizer state on the mesh, the data loaders, resume, the
hooks (NaN policy and training log from `rewardax.train_hooks`, evaluation and checkpoints every N
steps), stop signals, and the final evaluation and export. Over 500 lines because the reference
API is one class (construction checks, collate functions, evaluate, train, export) whose parts
share its state; the loop and its hooks live elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rewardax import data as rdata
from rewardax import distributed, hostmem
from rewardax.checkpoint import CHECKPOINT_SUBDIR, TrainCheckpointer
from rewardax.config import ModelSection, RewardConfig
from rewardax.data.rankings import (
    RankedPairs,
    data_layout,
    pair_view_ranking_metrics,
    rankings_as_pairs,
)
from rewardax.errors import CheckpointError, ConfigError
from rewardax.evaluation import reward_normalization
from rewardax.logging import MetricsLogger
from rewardax.loop import EveryNSteps, Loop
from rewardax.losses import SCORE_LOSSES
from rewardax.models import AutoRewardModel, ModelOptions, RewardModel, lora, smollm2_gguf_path
from rewardax.models.auto import read_architecture
from rewardax.models.kernels import compute_dtype
from rewardax.models.transformer import remat_fallback
from rewardax.optim import build_optimizer, build_schedule, constant_rate
from rewardax.pair_scoring import PairScorer, ScoreRowScorer
from rewardax.plan import memory_limit, resolve_auto
from rewardax.sharding import (
    batch_sharding,
    global_batch,
    make_mesh,
    on_host,
    optimizer_state_shardings,
    replicated,
    state_shardings,
    traced_in_mesh,
)
from rewardax.state import RewardState
from rewardax.steps import configured_train_step, jit_train_step, make_eval_step
from rewardax.train_hooks import NonFiniteGuard, TrainLog

EXPORT_DIRNAME = "export"
TOKENIZER_DIRNAME = "tokenizer"


class TrainerFunctions(NamedTuple):
    """What `configure_functions()` returns."""

    train_step: Any  # jitted (arrays, batch) -> (arrays, metrics)
    eval_step: Any  # jitted (arrays, batch) -> {"chosen": [B], "rejected": [B]}
    mesh: jax.sharding.Mesh


@dataclass
class TrainResult:
    """What `train()` returns: final metrics, the run directory and the exported model."""

    metrics: dict[str, Any]
    run_dir: Path
    export_dir: Path | None
    stopped_early: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "metrics": self.metrics,
            "run_dir": str(self.run_dir),
            "export_dir": str(self.export_dir) if self.export_dir else None,
            "stopped_early": self.stopped_early,
        }


def _check_model_section(section: ModelSection, model: RewardModel) -> None:
    """A model passed to the trainer carries its own precision, remat and dropout settings; a
    `model:` setting of the config that says otherwise would be silently ignored, so it is an
    error. Settings left at their defaults defer to the model."""
    if section.path is not None:
        raise ConfigError(
            f"model.path={section.path!r} is set and a model object was passed as well: pass "
            "model=None to load model.path, or drop model.path"
        )
    defaults = ModelSection()
    actual = {
        "dtype": model.dtype.name,
        "param_dtype": model.param_dtype.name,
        "matmul_dtype": None if model.matmul_dtype is None else model.matmul_dtype.name,
        "remat_policy": model.model.remat_policy,
        "dropout_rate": model.model.dropout_rate,
        "kernels": model.kernels if isinstance(model.kernels, str) else model.kernels.name,
        "num_labels": model.config.num_labels,
    }
    if section.objectives and model.config.num_labels != len(section.objectives):
        raise ConfigError(
            f"model.objectives names {len(section.objectives)} objectives, but the model passed "
            f"to RewardTrainer has a head of {model.config.num_labels} output(s): build it with "
            f"num_labels={len(section.objectives)}"
        )
    for name, value in actual.items():
        wanted = getattr(section, name)
        if wanted != getattr(defaults, name) and wanted != value:
            raise ConfigError(
                f"model.{name}={wanted!r} in the config, but the model passed to RewardTrainer "
                f"was built with {name}={value!r}: build the model with {name}={wanted!r}, "
                f"or drop model.{name} from the config"
            )


class RewardTrainer:
    """Trains a reward model on preference pairs.

    Args:
      arguments: the RewardConfig.
      processing_class: the tokenizer (`rx.load_tokenizer`).
      model: a `RewardModel`, a `RewardState` (model + optimizer state + step), or None (then
        `arguments.model.path` is loaded; None there means the built-in SmolLM2-135M-Instruct).
      train_dataset: a Hugging Face Dataset / IterableDataset, a ShardedDataSource, a path or a list
        of rows (see `rewardax.data`).
      eval_dataset: the same, or a dict of named eval sets.
      data_collator: must be None for now: rewardax tokenizes, length-groups and collates itself
        (`create_grain_collect_function` / `create_tfds_collect_function` expose that collation
        for other loaders). A custom collator is refused rather than silently ignored.
    """

    def __init__(
        self,
        arguments: RewardConfig,
        processing_class: Any,
        model: RewardModel | RewardState | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        data_collator: Any = None,
    ):
        if not isinstance(arguments, RewardConfig):
            raise ConfigError(
                f"arguments must be a rewardax.RewardConfig, got {type(arguments).__name__}"
            )
        self.config = arguments
        self.tokenizer = processing_class
        if data_collator is not None:
            raise ConfigError(
                "a custom data_collator is not supported yet: RewardTrainer builds its batches with "
                "its own loader (length-grouped, resumable). Pass data_collator=None, or use "
                "trainer.create_tfds_collect_function(...) with your own loop"
            )
        # Multi-process jobs join jax.distributed here, before the first device query (a no-op
        # when already initialized or when nothing asks for several processes).
        distributed.initialize(arguments)
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()

        # `auto` model settings decided for this machine, before anything reads them.
        cfg = self.config = self._decide_auto(arguments, model)
        cfg.validate(num_devices=jax.device_count(), num_processes=self.process_count)
        dp, fsdp, tp = cfg.mesh.resolve(jax.device_count())
        self.mesh = make_mesh(dp, fsdp, tp)
        self.data_parallel_size = dp * fsdp
        self.global_batch_size = cfg.train.per_device_train_batch_size * dp * fsdp
        self.accumulation_steps = cfg.train.gradient_accumulation_steps
        self.step_batch_size = self.global_batch_size * self.accumulation_steps

        self.train_loader = None
        if train_dataset is not None:
            self.train_loader = rdata.PreferenceLoader(
                train_dataset,
                self.tokenizer,
                cfg.data,
                batch_size=self.step_batch_size // self.process_count,
                seed=cfg.train.seed,
                process_index=self.process_index,
                process_count=self.process_count,
                row_multiple=self.data_parallel_size,
                loss=cfg.train.loss,
                max_responses=cfg.train.max_responses,
                objectives=cfg.model.objectives,
                microbatches=self.accumulation_steps,
            )
        self.eval_sets = self._named_eval_sets(eval_dataset)
        self.total_steps = self._total_steps()

        if self.total_steps > 0:
            self.schedule = build_schedule(cfg.optim, self.total_steps)
            self.optimizer = build_optimizer(cfg.optim, self.total_steps)
        else:  # nothing to train (evaluation only): the run's length and schedule are unknown
            self.schedule = build_schedule(constant_rate(cfg.optim), 1)
            self.optimizer = build_optimizer(constant_rate(cfg.optim), 1)
        self._model_passed = model is not None
        self.state = self._initial_state(model)
        self.model_config = self.state.model.config
        if cfg.model.objectives:  # the names travel with checkpoints and exports (id2label)
            self.model_config = self.model_config.replace(label_names=tuple(cfg.model.objectives))
        self._warn_remat_fallback()
        self.run_dir = Path(cfg.checkpoint.save_directory) / self.run_name()
        self._functions: TrainerFunctions | None = None
        self._checkpointer: TrainCheckpointer | None = None
        self._stop_signal: int | None = None

    # ----------------------------------------------------------------------------------- setup

    def _decide_auto(self, config: RewardConfig, model: Any) -> RewardConfig:
        """``config`` with ``model.dtype`` and ``model.remat_policy`` `auto` decided: a model
        object passed in keeps its own settings; a model the trainer loads gets the backend's
        (`rewardax.plan.resolve_auto`: bfloat16 compute off the CPU, and the fastest remat
        policy whose compiled step fits the device). ``config`` itself is not changed."""
        self._auto_chosen: dict[str, str] = {}
        self._remat_tried: tuple[str, ...] = ()
        if "auto" not in (config.model.dtype, config.model.remat_policy):
            return config
        given = model.model if isinstance(model, RewardState) else model
        if given is not None:
            config = config.model_copy(deep=True)
            if config.model.dtype == "auto":
                config.model.dtype = (
                    given.dtype.name
                    if isinstance(given, RewardModel)
                    else compute_dtype("auto", jax.default_backend())
                )
            if config.model.remat_policy == "auto":
                config.model.remat_policy = (
                    given.model.remat_policy if isinstance(given, RewardModel) else "none"
                )
            return config
        devices = jax.devices()
        arch = None
        if memory_limit(devices[0]) is not None:  # only a device's own memory is planned for
            arch = read_architecture(config.model.path or smollm2_gguf_path())
        config, self._auto_chosen, self._remat_tried = resolve_auto(config, arch, devices)
        return config

    def _warn_remat_fallback(self) -> None:
        """A warning when the model's remat policy keeps the splash kernel's residuals but no
        splash kernel runs (it then recomputes every block: remat full's speed and memory)."""
        model = self.state.model
        policy = model.model.remat_policy
        why = remat_fallback(policy, model.kernels)
        if why is not None:
            warnings.warn(
                f"model.remat_policy={policy} keeps what the splash attention kernel saves, but "
                f"{why}: it recomputes every layer, as remat full does. Set "
                "model.remat_policy=full to say so, or auto to let the trainer choose.",
                stacklevel=3,
            )

    def run_name(self) -> str:
        """The run directory's name: `checkpoint.run_name`, else the model's file or directory
        name (the architecture for a model object passed in) and a hash of the training settings
        (`SmolLM2-135M-Instruct.Q4_1-1a2b3c4d`, `llama-1a2b3c4d`), so that rerunning the same
        command finds (and resumes) the same run."""
        if self.config.checkpoint.run_name:
            return self.config.checkpoint.run_name
        settings = self.config.to_dict()
        for section in ("checkpoint", "logging", "eval", "mesh", "distributed"):
            settings.pop(section, None)
        for length_only in ("max_training_steps", "num_train_epochs"):
            settings["train"].pop(length_only, None)
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        if self.config.model.path:
            model = Path(self.config.model.path).name.removesuffix(".gguf")
        elif self._model_passed:  # named by its architecture, not by the built-in default
            model = self.model_config.architecture
        else:
            model = smollm2_gguf_path().name.removesuffix(".gguf")
        model = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip(".-")[:48] or "model"
        return f"{model}-{digest[:8]}"

    def _named_eval_sets(self, eval_dataset: Any) -> dict[str, Any]:
        if eval_dataset is None:
            return {}
        if isinstance(eval_dataset, Mapping) and not _looks_like_row(eval_dataset):
            return dict(eval_dataset)
        return {"eval": eval_dataset}

    def _total_steps(self) -> int:
        train = self.config.train
        if train.max_training_steps is not None:
            return int(train.max_training_steps)
        if self.train_loader is None:
            return 0
        if self.train_loader.streaming:
            raise ConfigError(
                "the training data has no known length (an IterableDataset?): set "
                "train.max_training_steps"
            )
        per_epoch = self.train_loader.local_rows // self.train_loader.batch_size
        # Processes' slices differ by up to one row; all must run the same number of steps.
        per_epoch = -distributed.agree_max(-per_epoch)
        if per_epoch == 0:
            raise ConfigError(
                f"the training data holds fewer pairs than one step needs ({self.step_batch_size} "
                "= per_device_train_batch_size x data-parallel devices x "
                "gradient_accumulation_steps): lower the batch size or add data"
            )
        return int(per_epoch * train.num_train_epochs)

    def _initial_state(self, model: RewardModel | RewardState | None) -> RewardState:
        cfg = self.config
        given = model.model if isinstance(model, RewardState) else model
        if isinstance(given, RewardModel):  # another NNX module has no such settings to compare
            _check_model_section(cfg.model, given)
        if model is None:
            path = cfg.model.path or smollm2_gguf_path()
            options = ModelOptions.from_section(cfg.model, seed=cfg.train.seed)
            model = AutoRewardModel.load(path, options)
        if isinstance(model, RewardState):
            state = model
        else:
            # A passed model gets its adapters in place (a copy would double its memory).
            model = lora.add_configured_adapters(model, cfg.model, seed=cfg.train.seed)
            # Not RewardState.create: its eager optimizer.init would build the moments unsharded
            # on one device (3x the parameters' memory with Adam) before _shard_state shards them.
            # With LoRA, `params` are the adapters and the head; the frozen rest is in `rest`.
            graphdef, params, rest = lora.split(model)
            state = RewardState(
                graphdef=graphdef,
                params=params,
                rest=rest,
                opt_state=None,
                step=jnp.asarray(0, jnp.int32),
                rng=jax.random.key_data(jax.random.key(cfg.train.seed)),
            )
        return self._shard_state(state)

    def _shard_state(self, state: RewardState) -> RewardState:
        """Places parameters by the sharding table; the optimizer state follows the parameters."""
        param_shardings = state_shardings(state.params, self.mesh)
        if self.config.optim.offload_params:
            param_shardings = on_host(param_shardings)
        params = jax.device_put(state.params, param_shardings)
        rest = jax.device_put(state.rest, state_shardings(state.rest, self.mesh))
        opt_shardings = optimizer_state_shardings(
            self.optimizer, state.params, self.mesh, offload=self.config.optim.offload_state
        )
        if _is_fresh(state):
            opt_state = jax.jit(self.optimizer.init, out_shardings=opt_shardings)(params)
        else:
            opt_state = jax.device_put(state.opt_state, opt_shardings)
        return RewardState(
            graphdef=state.graphdef,
            params=params,
            rest=rest,
            opt_state=opt_state,
            step=jax.device_put(state.step, replicated(self.mesh)),
            rng=jax.device_put(state.rng, replicated(self.mesh)),
        )

    def _dropout_rate(self) -> float:
        """The model's own rate (a model passed in may have been built with dropout that the
        config's default 0.0 does not mention); the config's for another NNX module."""
        model = self.state.model
        if isinstance(model, RewardModel):
            return model.model.dropout_rate
        return self.config.model.dropout_rate

    def configure_functions(self) -> TrainerFunctions:
        """JIT-compiles the train and eval steps for the current state's shardings."""
        if self._functions is not None:
            return self._functions
        cfg = self.config
        train_step = configured_train_step(
            cfg,
            self.state.graphdef,
            self.optimizer,
            self.schedule,
            dropout=self._dropout_rate() > 0,
        )
        shardings = jax.tree.map(lambda x: x.sharding, self.state.arrays())
        data = batch_sharding(self.mesh)
        jitted_train = jit_train_step(train_step, shardings, self.mesh)
        jitted_eval = jax.jit(
            traced_in_mesh(make_eval_step(self.state.graphdef), self.mesh),
            in_shardings=(shardings, data),
            out_shardings=replicated(self.mesh),
        )
        self._functions = TrainerFunctions(jitted_train, jitted_eval, self.mesh)
        return self._functions

    def checkpointer(self) -> TrainCheckpointer:
        """The run's checkpoints (`<run>/checkpoints`), opened on first use."""
        if self._checkpointer is None:
            self._checkpointer = TrainCheckpointer(
                self.run_dir / CHECKPOINT_SUBDIR,
                max_to_keep=self.config.checkpoint.save_total_limit,
                process_index=self.process_index,
            )
        return self._checkpointer

    # ------------------------------------------------- the reference API's collate functions

    def create_grain_collect_function(
        self, max_sequence_length: int, truncation_mode: str = "keep_end"
    ):
        """Per-record collate function for Grain pipelines (tokenizer and pad id bound)."""
        return rdata.create_grain_collect_function(
            self.tokenizer, max_sequence_length, truncation_mode, data_config=self.config.data
        )

    def create_tfds_collect_function(
        self, max_sequence_length: int, truncation_mode: str = "keep_end"
    ):
        """List-of-records -> batch collate function, for tf.data or any loader yielding lists."""
        return rdata.create_tfds_collect_function(
            self.tokenizer, max_sequence_length, truncation_mode, data_config=self.config.data
        )

    # ----------------------------------------------------------------------------- training

    def train(self) -> TrainResult:
        """Trains for `total_steps`, evaluating, logging and checkpointing as configured.

        Returns a TrainResult (final metrics, run directory, exported Hugging Face directory).
        """
        if self.train_loader is None:
            raise ConfigError("RewardTrainer.train() needs a train_dataset")
        cfg = self.config
        fns = self.configure_functions()
        ckpt = self.checkpointer()
        start_step = self._maybe_resume(ckpt)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.process_index == 0:
            # YAML, so `rewardax train --config <run_dir>/config.yaml` reruns the same job.
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
            if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(str(self.run_dir / TOKENIZER_DIRNAME))

        logger = MetricsLogger(
            self.run_dir,
            report_to=list(cfg.logging.report_to),
            process_index=self.process_index,
            total_steps=self.total_steps,
            progress_bar=cfg.logging.progress_bar,
            resume_step=start_step if start_step > 0 else None,
        )
        if self._auto_chosen and jax.default_backend() != "cpu":
            # Off the CPU the choice depends on the device: say what was chosen (and why).
            chosen = ", ".join(f"{k}={v}" for k, v in self._auto_chosen.items())
            why = f" (remat compiled: {'; '.join(self._remat_tried)})" if self._remat_tried else ""
            logger.event(
                start_step,
                "auto_settings",
                f"auto settings: {chosen}{why}",
                {**self._auto_chosen, "remat_tried": "; ".join(self._remat_tried)},
            )
        if self._resumed_from is not None:
            # A rerun that picks a run up must say so, on stderr and in metrics.jsonl.
            logger.event(
                start_step,
                "resume",
                f"resuming run {self.run_name()} from step {start_step} ({self._resumed_from})",
                {"run": self.run_name(), "checkpoint": str(self._resumed_from)},
            )
        final_metrics: dict[str, Any] = {}
        previous_handlers = self._install_signal_handlers()
        try:
            if cfg.eval.eval_at_start and start_step == 0 and self.eval_sets:
                final_metrics["eval_before"] = self._evaluate_and_log(logger, step=0)

            def evaluate(step: int) -> None:
                final_metrics["eval"] = self._evaluate_and_log(logger, step)
                final_metrics["eval_step"] = step

            self._save_seconds = 0.0
            train_log = TrainLog(self, logger, final_metrics)
            evaluation = EveryNSteps(cfg.eval.eval_steps if self.eval_sets else 0, evaluate)
            checkpoints = EveryNSteps(cfg.checkpoint.save_steps, lambda s: self._save(ckpt, s))
            loop = Loop(
                fns.train_step,
                # In this order: a NaN step is refused before it is logged, evaluated or saved.
                hooks=[NonFiniteGuard(self, ckpt), train_log, evaluation, checkpoints],
                should_stop=self._stop_requested,
                # The step donated the arrays self.state held: it holds the new ones before
                # any hook can raise.
                on_arrays=lambda arrays: setattr(self, "state", self.state.replace_arrays(arrays)),
            )
            loop_start = time.perf_counter()
            out = loop.run(
                self.state.arrays(),
                distributed.lockstep(self.train_loader, self.train_loader.pad_id),
                to_device=lambda host_batch: global_batch(_model_inputs(host_batch), self.mesh),
                start_step=start_step,
                total_steps=self.total_steps,
            )
            step = out.step
            last_saved = checkpoints.last_step if checkpoints.last_step is not None else start_step
            if out.stopped_early:
                if last_saved != step:
                    self._save(ckpt, step)
                return TrainResult(final_metrics, self.run_dir, None, stopped_early=True)
            if last_saved != step and cfg.checkpoint.save_final:
                self._save(ckpt, step)  # the final state, whatever save_steps is
            loop_s = time.perf_counter() - loop_start
            export_start = time.perf_counter()
            export_dir = self._finish(logger, final_metrics, step)
            # Where train() spent its time: the steps (compilations included; evaluations and
            # checkpoint writes excluded), the checkpoint writes, the final evaluation + export.
            final_metrics["timing"] = {
                "steps_s": round(loop_s - self._save_seconds - evaluation.seconds, 3),
                "checkpoint_s": round(self._save_seconds, 3),
                "eval_s": round(evaluation.seconds, 3),
                "finish_s": round(time.perf_counter() - export_start, 3),
                # Distinct batch shapes this train() ran: each needs its own compiled train step.
                "batch_shapes": len(train_log.batch_shapes),
            }
            logger.summary(
                {
                    "step": step,
                    "export_dir": str(export_dir),
                    "data": final_metrics["data"],
                    "train": final_metrics.get("train", {}),
                    "host_memory": hostmem.status(),
                }
            )
            return TrainResult(final_metrics, self.run_dir, export_dir)
        finally:
            self._restore_signal_handlers(previous_handlers)
            logger.close()

    _skipped_steps = 0
    _save_seconds = 0.0
    _scorer: PairScorer | None = None
    # The step directory the last train() resumed from (None: a fresh start).
    _resumed_from: Path | None = None

    def _stop_requested(self) -> bool:
        """True once a stop signal arrived, on every process at the same step: a scheduler signals
        processes at slightly different moments, and one stopping alone would hang the others."""
        local = self._stop_signal is not None
        if self.process_count == 1:
            return local
        return distributed.agree_max(int(local)) > 0

    def _finish(self, logger: MetricsLogger, final_metrics: dict, step: int) -> Path:
        """Final evaluation, reward statistics for normalisation, and the Hugging Face export."""
        normalization = None
        if self.eval_sets:
            # The last step's evaluation when eval_steps already ran it, else a new one.
            if final_metrics.pop("eval_step", None) == step:
                evaluation = final_metrics["eval"]
            else:
                evaluation = self._evaluate_and_log(logger, step)
            rewards = np.concatenate([r.all_rewards() for r in self._last_rewards.values()])
            normalization = reward_normalization(rewards)
            final_metrics["eval"] = evaluation
        final_metrics["data"] = self.train_loader.stats.as_dict()
        final_metrics["step"] = step
        export_dir = self.run_dir / EXPORT_DIRNAME
        extra = {"rewardax": {"trained_steps": step}}
        if normalization is not None:
            extra["rewardax"]["reward_normalization"] = normalization
        if self.model_config.label_names:  # a passed model's head may not carry the names
            names = self.model_config.to_hf_dict()
            extra.update(id2label=names["id2label"], label2id=names["label2id"])
        model = self.state.model
        if self.process_count > 1:
            # Parameters sharded over several processes: gather them (a collective) first.
            params, rest = distributed.gather_to_host((self.state.params, self.state.rest))
            arrays = {**self.state.arrays(), "params": params, "rest": rest}
            model = self.state.replace_arrays(arrays).model
        if lora.has_adapters(model):  # a plain *ForSequenceClassification: adapters merged
            model = lora.merged(model)
        if self.process_index == 0:
            model.save_pretrained(
                export_dir, tokenizer=self.tokenizer, extra_config=extra, overwrite=True
            )
        return export_dir

    # --------------------------------------------------------------------------- evaluation

    def evaluate(self, eval_dataset: Any = None) -> dict[str, dict[str, Any]]:
        """Evaluates every named eval set over all its pairs; returns metrics per set.

        Rows ranking K responses are scored as the pairs they imply (pair metrics) and also
        get `ranking` (`rankings.ranking_metrics`: Spearman ρ, Kendall τ, top-1 accuracy per
        row, and the run's ranking loss per row when train.loss is one); score rows get `rankings.score_metrics` (with MSE when train.loss predicts the
        score: mse or gaussian_nll)."""
        sets = self._named_eval_sets(eval_dataset) if eval_dataset is not None else self.eval_sets
        if not sets:
            raise ConfigError("evaluate() needs an eval_dataset (here or in the constructor)")
        if self._scorer is None:  # one compiled eval step per batch shape, for the whole run
            scorer_args = dict(
                mesh=self.mesh,
                tokenizer=self.tokenizer,
                data_config=self.config.data,
                batch_size=self.config.train.per_device_eval_batch_size * self.data_parallel_size,
            )
            self._scorer = PairScorer(self.state.graphdef, **scorer_args)
            self._score_row_scorer = ScoreRowScorer(
                self.state.graphdef, objectives=self.config.model.objectives, **scorer_args
            )
        arrays = {"params": self.state.params, "rest": self.state.rest}
        results, self._last_rewards = {}, {}
        for name, source in sets.items():
            source = rdata.load_source(source)
            if data_layout(source) == "scores":
                rewards = self._score_row_scorer(arrays, source)
                metrics = rewards.metrics(mse=self.config.train.loss in SCORE_LOSSES)
            else:
                source = rankings_as_pairs(source)
                rewards = self._scorer(arrays, source)
                # With the pairs cut to data.max_sequence_length and the rows left out, counted.
                metrics = rewards.metrics()
                if isinstance(source, RankedPairs):
                    metrics["ranking"] = pair_view_ranking_metrics(
                        source, rewards, self.config.train
                    )
            self._last_rewards[name] = rewards
            results[name] = metrics
        return results

    def _evaluate_and_log(self, logger: MetricsLogger, step: int) -> dict:
        results = self.evaluate()
        for name, metrics in results.items():
            scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
            # Ranked rows' `ranking` metrics as ranking_spearman, ranking_kendall_tau, ...
            ranking = metrics.get("ranking") or {}
            scalars.update(
                {f"ranking_{k}": v for k, v in ranking.items() if isinstance(v, int | float)}
            )
            # Named scores' per-objective metrics as NAME/spearman, NAME/mse, ...
            for objective, values in (metrics.get("objectives") or {}).items():
                scalars.update(
                    {f"{objective}/{k}": v for k, v in values.items() if isinstance(v, int | float)}
                )
            logger.log(step, scalars, prefix=f"eval/{name}")
        return results

    # -------------------------------------------------------------------------- checkpoints

    def _save(self, ckpt: TrainCheckpointer, step: int) -> None:
        data_state = self.train_loader.get_state()
        if self.process_count > 1:
            # Each process reads its own rows: keep every process's position (a collective).
            data_state = {"per_process": distributed.gather_json(data_state)}
        extra = {
            "data_state": data_state,
            "config": self.config.to_dict(),
            # The architecture, so `rewardax export` rebuilds the model from the checkpoint alone.
            "model_config": self.model_config.to_hf_dict(),
            "skipped_steps": int(self._skipped_steps),
        }
        start = time.perf_counter()
        ckpt.save(step, self.state.arrays(), extra)
        self._save_seconds += time.perf_counter() - start

    def _maybe_resume(self, ckpt: TrainCheckpointer) -> int:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            self.state.arrays(),
        )
        if self.config.checkpoint.resume == "off" and ckpt.steps():
            # A fresh run here would keep the old run's checkpoints at every step it saves too
            # (a valid one is never replaced) and a later resume would mix the two runs.
            raise CheckpointError(
                f"checkpoint.resume=off, but {ckpt.directory} already holds checkpoints "
                f"{ckpt.steps()} of an earlier run; refusing to overwrite or mix them. Choose "
                "another checkpoint.run_name (or save_directory), delete that folder, or resume "
                "(checkpoint.resume=auto)"
            )
        self._resumed_from = None
        restored = ckpt.resume(self.config.checkpoint.resume, abstract)
        if restored is None:
            return 0
        self._resumed_from = restored.path
        step, arrays, extra = restored
        self.state = self.state.replace_arrays(arrays)
        data_state = extra["data_state"]
        if "per_process" in data_state:
            states = data_state["per_process"]
            if len(states) != self.process_count:
                raise ConfigError(
                    f"the checkpoint was written by {len(states)} processes and this run has "
                    f"{self.process_count}; the data order cannot be continued. Resume with "
                    f"{len(states)} processes, or start a new run (checkpoint.resume=off)"
                )
            data_state = states[self.process_index]
        self.train_loader.set_state(data_state)
        self._skipped_steps = int(extra.get("skipped_steps", 0))
        return int(step)

    # ------------------------------------------------------------------------------ signals

    def _install_signal_handlers(self):
        def handler(signum, _frame):
            # Finish the step in flight, then save and return: never interrupt a write.
            self._stop_signal = signum

        previous = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            warnings.warn(
                "RewardTrainer.train() outside the main thread: SIGTERM not handled", stacklevel=2
            )
        return previous

    @staticmethod
    def _restore_signal_handlers(previous) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _model_inputs(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays the jitted steps take (eval batches also carry bookkeeping such as row_index).

    A packed batch (it has `reward_slot`) keeps its own keys (`rewardax.data.packing`), a group
    batch (it has `row_mask`) its own (`rewardax.data.groups`).
    """
    if "row_mask" in batch:
        return {k: batch[k] for k in rdata.GROUP_KEYS if k in batch}
    if "reward_slot" in batch:
        keys = rdata.SHARED_PROMPT_KEYS if "branch_ids" in batch else rdata.PACKED_KEYS
        return {k: batch[k] for k in keys}
    return {k: batch[k] for k in rdata.BATCH_KEYS}


def _looks_like_row(d: Mapping) -> bool:
    return "chosen" in d or "chosen_input_ids" in d


def _is_fresh(state: RewardState) -> bool:
    return int(jax.device_get(state.step)) == 0
