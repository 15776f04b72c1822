"""The generic loop (`rewardax.loop`): steps, hook order, every-N hooks, early stop, and the
caller holding the newest arrays when a hook raises."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from rewardax.loop import EveryNSteps, Hook, Loop, StepOutput


def add_batch(arrays, batch):
    """A toy step: the state sums its batches; metrics say what it saw."""
    new = {"total": arrays["total"] + batch, "steps": arrays["steps"] + 1}
    return new, {"batch": batch, "total": new["total"]}


class Record(Hook):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def on_start(self, start_step):
        self.log.append((self.name, "start", start_step))

    def after_step(self, out: StepOutput):
        self.log.append((self.name, out.step, float(out.metrics["total"]), out.batch))


def test_steps_run_in_order_and_hooks_see_each_step_in_their_order():
    log, held = [], []
    loop = Loop(add_batch, hooks=[Record("a", log), Record("b", log)], on_arrays=held.append)
    result = loop.run(
        {"total": jnp.float32(10), "steps": jnp.int32(3)},
        iter([1.0, 2.0, 3.0, 4.0]),
        to_device=jnp.float32,
        start_step=3,
        total_steps=6,
    )
    assert (result.step, result.stopped_early) == (6, False)
    assert float(result.arrays["total"]) == 16.0 and int(result.arrays["steps"]) == 6
    assert log == [
        ("a", "start", 3),
        ("b", "start", 3),
        ("a", 4, 11.0, 1.0),
        ("b", 4, 11.0, 1.0),
        ("a", 5, 13.0, 2.0),
        ("b", 5, 13.0, 2.0),
        ("a", 6, 16.0, 3.0),
        ("b", 6, 16.0, 3.0),
    ]
    assert [float(a["total"]) for a in held] == [11.0, 13.0, 16.0]
    assert isinstance(log[2][2], float)  # metrics reach the hooks on the host


def test_every_n_steps_runs_on_multiples_and_never_for_zero():
    ran, never = [], []
    every_two = EveryNSteps(2, ran.append)
    off = EveryNSteps(0, never.append)
    Loop(add_batch, hooks=[every_two, off]).run(
        {"total": jnp.float32(0), "steps": jnp.int32(0)},
        itertools.repeat(1.0),
        to_device=jnp.float32,
        start_step=1,
        total_steps=7,
    )
    assert ran == [2, 4, 6] and every_two.last_step == 6 and every_two.seconds >= 0
    assert never == [] and off.last_step is None


def test_should_stop_ends_before_the_next_step():
    seen = []
    stops = iter([False, False, True])
    result = Loop(add_batch, hooks=[Record("a", seen)], should_stop=lambda: next(stops)).run(
        {"total": jnp.float32(0), "steps": jnp.int32(0)},
        itertools.repeat(1.0),
        to_device=jnp.float32,
        start_step=0,
        total_steps=10,
    )
    assert (result.step, result.stopped_early) == (2, True)
    assert float(result.arrays["total"]) == 2.0 and len(seen) == 3  # start + 2 steps


def test_a_hook_that_raises_leaves_the_caller_with_the_newest_arrays():
    held = []

    class Refuse(Hook):
        def after_step(self, out):
            if out.step == 2:
                raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        Loop(add_batch, hooks=[Refuse()], on_arrays=held.append).run(
            {"total": jnp.float32(0), "steps": jnp.int32(0)},
            itertools.repeat(np.float32(5)),
            to_device=jnp.asarray,
            start_step=0,
            total_steps=4,
        )
    assert [float(a["total"]) for a in held] == [5.0, 10.0]
