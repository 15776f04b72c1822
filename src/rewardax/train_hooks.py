"""The reward trainer's hooks on `rewardax.loop.Loop`: its NaN policy and its training log.

Evaluation and checkpoints are `loop.EveryNSteps` hooks around `RewardTrainer` methods; these two
read the trainer's config, loader and counters (``trainer``: a `rewardax.trainer.RewardTrainer`).
"""

from __future__ import annotations

import time
from typing import Any

from rewardax import data as rdata
from rewardax import distributed
from rewardax.checkpoint import TrainCheckpointer
from rewardax.errors import NonFiniteError
from rewardax.logging import MetricsLogger
from rewardax.loop import Hook, StepOutput


class NonFiniteGuard(Hook):
    """train.nan_policy: `error` stops at a NaN/Inf step (the step returned the state unchanged;
    the trainer keeps it, its counter taken back); `skip_step` counts it and goes on."""

    def __init__(self, trainer: Any, ckpt: TrainCheckpointer):
        self.trainer, self.ckpt = trainer, ckpt

    def after_step(self, out: StepOutput) -> None:
        if not out.metrics["nonfinite"]:
            return
        trainer, metrics = self.trainer, out.metrics
        if trainer.config.train.nan_policy == "error":
            arrays = {**out.arrays, "step": out.arrays["step"] - 1}
            trainer.state = trainer.state.replace_arrays(arrays)
            raise NonFiniteError(
                f"step {out.step}: the loss or the gradients are NaN/Inf (loss="
                f"{float(metrics['loss'])}, grad_norm={float(metrics['grad_norm'])}); "
                f"the update was not applied and nothing was saved. The last "
                f"checkpoint ({last_saved_text(self.ckpt)}) is intact. Lower the learning "
                "rate, check the data, or set train.nan_policy=skip_step"
            )
        trainer._skipped_steps = int(trainer._skipped_steps) + 1


class TrainLog(Hook):
    """Every logging.logging_steps steps (and the last): the step's metrics with pairs/s and
    tokens/s over the steps since the previous line, padding efficiency, skipped steps, epoch.
    Also counts the distinct batch shapes run (each is a compiled train step)."""

    def __init__(self, trainer: Any, logger: MetricsLogger, final_metrics: dict):
        self.trainer, self.logger, self.final_metrics = trainer, logger, final_metrics
        self.batch_shapes: set[tuple] = set()

    def on_start(self, start_step: int) -> None:
        self.window_start, self.pairs, self.tokens = time.perf_counter(), 0.0, 0.0

    def after_step(self, out: StepOutput) -> None:
        trainer = self.trainer
        self.batch_shapes.add(tuple((k, v.shape) for k, v in sorted(out.batch.items())))
        # Group batches (a group loss) count rows.
        self.pairs += float(out.metrics.get("num_pairs", out.metrics.get("num_rows", 0.0)))
        self.tokens += float(rdata.token_counts(out.batch)[0])
        every = trainer.config.logging.logging_steps
        if out.step % every and out.step != trainer.total_steps:
            return
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        tokens = distributed.process_sum(self.tokens)  # this process's rows only
        row = {k: float(v) for k, v in out.metrics.items()}
        row.update(
            pairs_per_second=self.pairs / elapsed,
            tokens_per_second=tokens / elapsed,
            padding_efficiency=trainer.train_loader.stats.padding_efficiency,
            skipped_steps=int(trainer._skipped_steps),
            epoch=trainer.train_loader.epoch,
        )
        self.logger.log(out.step, row, prefix="train")
        self.final_metrics["train"] = row
        self.on_start(out.step)


def last_saved_text(ckpt: TrainCheckpointer) -> str:
    steps = ckpt.steps()
    return f"step {steps[-1]} in {ckpt.directory}" if steps else "none written yet"
