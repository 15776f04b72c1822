"""A training loop that knows nothing about preferences: a step function, batches, and hooks.

`Loop.run` calls ``step_fn(arrays, batch) -> (arrays, metrics)`` until ``total_steps`` steps are
done or ``should_stop()`` says so, and hands every step's outcome to its hooks in order. What a
step means (a reward model's pairs, its loss) and what happens around it (logging, evaluation,
checkpoints, a NaN policy) is the hooks' business; `rewardax.trainer.RewardTrainer` assembles
them. The step function may donate its input arrays: the loop holds only the newest ones, and
``on_arrays`` is told of them before any hook runs, so a hook that raises leaves the caller with
live buffers.

Example::

    loop = Loop(step_fn, hooks=[EveryNSteps(100, save)], should_stop=lambda: False)
    result = loop.run(arrays, batches, to_device=jnp.asarray, start_step=0, total_steps=1000)
    result.step, result.stopped_early
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class StepOutput:
    """One step's outcome, as the hooks see it.

    Attributes:
      step: steps done, this one included.
      arrays: the arrays the step returned (the state after it).
      metrics: the step's metrics, copied to the host.
      batch: the host batch the step ran on.
    """

    step: int
    arrays: Any
    metrics: dict[str, Any]
    batch: Any


@dataclass(frozen=True)
class LoopResult:
    step: int
    arrays: Any
    stopped_early: bool


class Hook:
    """Called by `Loop.run`: `on_start` once before the first step, `after_step` after each."""

    def on_start(self, start_step: int) -> None:
        pass

    def after_step(self, out: StepOutput) -> None:
        pass


class EveryNSteps(Hook):
    """Runs ``action(step)`` after every ``every``-th step (0 or None: never); keeps the time it
    took (`seconds`) and the last step it ran at (`last_step`, None before)."""

    def __init__(self, every: int | None, action: Callable[[int], Any]):
        self.every, self.action = every, action
        self.seconds = 0.0
        self.last_step: int | None = None

    def after_step(self, out: StepOutput) -> None:
        if self.every and out.step % self.every == 0:
            start = time.perf_counter()
            self.action(out.step)
            self.seconds += time.perf_counter() - start
            self.last_step = out.step


class Loop:
    """Steps over batches, hooks after each step.

    Args:
      step_fn: ``(arrays, device_batch) -> (arrays, metrics)``; may donate ``arrays``.
      hooks: called in this order after every step (and at the start).
      should_stop: asked before every step; True ends the run early (e.g. a signal arrived).
      on_arrays: told of the newest arrays right after each step, before the hooks.
    """

    def __init__(
        self,
        step_fn: Callable[[Any, Any], tuple[Any, Any]],
        *,
        hooks: Sequence[Hook] = (),
        should_stop: Callable[[], bool] = lambda: False,
        on_arrays: Callable[[Any], None] = lambda arrays: None,
    ):
        self.step_fn, self.hooks = step_fn, list(hooks)
        self.should_stop, self.on_arrays = should_stop, on_arrays

    def run(
        self,
        arrays: Any,
        batches: Iterator[Any],
        *,
        to_device: Callable[[Any], Any],
        start_step: int,
        total_steps: int,
    ) -> LoopResult:
        """Runs steps ``start_step + 1 .. total_steps`` (fewer when stopped early)."""
        for hook in self.hooks:
            hook.on_start(start_step)
        step = start_step
        while step < total_steps:
            if self.should_stop():
                return LoopResult(step, arrays, stopped_early=True)
            batch = next(batches)
            arrays, metrics = self.step_fn(arrays, to_device(batch))
            self.on_arrays(arrays)
            step += 1
            out = StepOutput(step, arrays, jax.device_get(metrics), batch)
            for hook in self.hooks:
                hook.after_step(out)
        return LoopResult(step, arrays, stopped_early=False)
