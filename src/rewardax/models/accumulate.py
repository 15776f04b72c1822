"""Gradient accumulation where each gradient is made: a microbatch's gradient added to the
step's running sum inside its backward pass.

A step of several microbatches sums their gradients in float32 (`rewardax.steps`). Added after
each microbatch's backward pass, the embedding's share costs a dense [vocab, hidden] gradient per
microbatch (zero-filled, its rows scatter-added) and a pass that adds it to the sum: Qwen2.5-0.5B
at 8 x 2048 tokens on a TPU v5e spent 16 ms of a 926 ms step in that add alone
(benchmarks/results/tpu_v5e_2026-12-07_rope_ops.md).

Here the sum goes into the model, and the step differentiates with respect to it:

- each parameter's value passes through `gradient_into(value, sum)`, whose gradient with respect
  to ``sum`` is ``sum + the value's gradient`` (`route_gradients` applies it by path to a
  module's parameter state);
- the embedding's lookup is `embed_into`, whose gradient is the sum with the looked-up rows'
  gradients scatter-added into it, in place. Compiled for a v5e, the per-microbatch dense
  gradient, its zero fill and its add are gone from the program.

The layers' stacked parameters are routed outside the layer loop. Inside it, next to the
weight-gradient matmuls, XLA:TPU fused the add into them but then copied each stacked gradient
into the microbatch loop's carry: the same memory passes, and 0.1 GiB more.
`Kernels.accumulate_in_backward` (`rewardax.models.kernels`) says where this is used.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


@jax.custom_vjp
def gradient_into(value: jax.Array, accumulator: jax.Array) -> jax.Array:
    """``value``. Differentiated with respect to ``accumulator`` (same shape), the gradient is
    ``accumulator + value's gradient`` in ``accumulator``'s dtype; with respect to ``value``, it
    is value's own gradient.

    Example::

        grad = jax.grad(lambda acc: jnp.sum(3.0 * gradient_into(w, acc)))(acc)  # acc + 3
    """
    return value


def _gradient_into_fwd(value, accumulator):
    return value, accumulator


def _gradient_into_bwd(accumulator, grad):
    return grad, accumulator + grad.astype(accumulator.dtype)


gradient_into.defvjp(_gradient_into_fwd, _gradient_into_bwd)


@jax.custom_vjp
def embed_into(table: jax.Array, ids: jax.Array, accumulator: jax.Array) -> jax.Array:
    """``table[ids]`` (rows of the [V, E] table for int ids of any shape). Differentiated with
    respect to ``accumulator`` ([V, E]), the gradient is ``accumulator`` with each looked-up
    row's gradient added at its id (a scatter-add of the rows used, in ``accumulator``'s dtype);
    ``table`` gets none."""
    return jnp.take(table, ids, axis=0)


def _embed_into_fwd(table, ids, accumulator):
    return jnp.take(table, ids, axis=0), (ids, accumulator)


def _embed_into_bwd(residuals, grad):
    ids, accumulator = residuals
    return None, None, accumulator.at[ids].add(grad.astype(accumulator.dtype))


embed_into.defvjp(_embed_into_fwd, _embed_into_bwd)


def route_gradients(state: nnx.State, accumulator: nnx.State | None, where: str) -> nnx.State:
    """``state`` (a module's variables) with each leaf that ``accumulator`` holds at the same
    path passed through `gradient_into`. A leaf of ``accumulator`` with no variable at its path
    is a ValueError (its gradient would be lost): ``where`` names the module in the message."""
    if accumulator is None:
        return state
    pending = dict(nnx.to_flat_state(accumulator))
    routed = []
    for path, variable in nnx.to_flat_state(state):
        if path in pending:
            total = _value(pending.pop(path))
            variable = variable.replace(gradient_into(variable.get_value(), total))
        routed.append((path, variable))
    if pending:
        names = ", ".join(".".join(map(str, path)) for path in pending)
        raise ValueError(f"gradient accumulator: {where} has no parameter at {names}")
    return nnx.from_flat_state(routed)


def routed_module(module: Any, accumulator: nnx.State | None, where: str) -> Any:
    """``module``, or a copy whose parameters route their gradients into ``accumulator``."""
    if accumulator is None:
        return module
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, route_gradients(state, accumulator, where))


def part(accumulator: nnx.State | None, key: str) -> nnx.State | None:
    """The sub-state of ``accumulator`` under ``key`` (None when absent)."""
    if accumulator is None or key not in accumulator:
        return None
    return accumulator[key]


def check_keys(accumulator: nnx.State | None, known: tuple[str, ...], where: str) -> None:
    """ValueError when ``accumulator`` holds a key outside ``known``: a parameter the module
    does not route would get no gradient."""
    if accumulator is None:
        return
    unknown = sorted(set(accumulator.keys()) - set(known))
    if unknown:
        raise ValueError(f"gradient accumulator: {where} has no parameters {', '.join(unknown)}")


def _value(leaf: Any) -> jax.Array:
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
