"""The optimizer and learning-rate schedule of a run, built from `RewardConfig.optim`.

Steps are optimizer updates (after gradient accumulation), counted from 0 by optax. The schedule
follows Hugging Face's `get_{constant,linear,cosine}_schedule_with_warmup`, so a recipe written for
TRL means the same here: linear warmup from 0 at step 0 to `learning_rate` at step `warmup_steps`,
then constant, linear or cosine decay reaching `final_learning_rate` at step `total_steps`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rewardax.config import OptimSection
from rewardax.errors import ConfigError

# The usual second-moment decay of each optimizer, used when `optim.beta2` is null.
_DEFAULT_BETA2 = {"adamw": 0.999, "lion": 0.99}


def resolve_warmup_steps(optim: OptimSection, total_steps: int) -> int:
    """Warmup length in optimizer steps: warmup_steps, or ceil(warmup_ratio × total_steps)."""
    if optim.warmup_ratio > 0:
        return math.ceil(optim.warmup_ratio * total_steps)
    return optim.warmup_steps


def build_schedule(optim: OptimSection, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the optimizer step (0-based).

    Args:
      optim: the optimizer section (learning_rate, schedule, warmup_*, final_learning_rate).
      total_steps: optimizer updates of the whole run.

    Returns:
      schedule(step) -> float32 scalar. Example (linear, lr 2e-5, 5 warmup steps, 80 steps):
      step 0 -> 0, step 5 -> 2e-5, step 80 -> final_learning_rate.
    """
    if total_steps < 1:
        raise ConfigError(f"the run has {total_steps} optimizer steps; it needs at least 1")
    warmup = resolve_warmup_steps(optim, total_steps)
    if warmup > total_steps:
        raise ConfigError(
            f"optim.warmup_steps={warmup} is more than the {total_steps} optimizer steps of the "
            "run; lower it (or use optim.warmup_ratio)"
        )
    peak = optim.learning_rate
    decay_steps = max(total_steps - warmup, 1)
    if optim.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif optim.schedule == "linear":
        after = optax.linear_schedule(peak, optim.final_learning_rate, decay_steps)
    elif optim.schedule == "cosine":
        # alpha is the end value as a fraction of the peak: peak·(alpha + (1−alpha)·½(1+cos πt)).
        after = optax.cosine_decay_schedule(peak, decay_steps, optim.final_learning_rate / peak)
    else:
        raise ConfigError(f"optim.schedule={optim.schedule!r}: use constant, linear or cosine")
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _path_names(path: tuple) -> list[str]:
    names = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                names.append(str(getattr(key, attribute)).lower())
                break
    return names


def weight_decay_mask(params: Any) -> Any:
    """True for the parameters weight decay applies to; same tree structure as `params`.

    Decay shrinks weights towards 0; for norm scales (whose neutral value is 1) and biases it
    only hurts, so a parameter is excluded when a name on its path contains "norm" or "bias" or
    when it has at most one dimension. Works on dicts and on flax `nnx.State` trees.
    """

    def decays(path: tuple, leaf: Any) -> bool:
        names = _path_names(path)
        if any("norm" in name or "bias" in name for name in names):
            return False
        return getattr(leaf, "ndim", 0) > 1

    return jax.tree_util.tree_map_with_path(decays, params)


class FusedAdamW(NamedTuple):
    """optax's ``chain(clip_by_global_norm, adamw)`` with a fused update for the train step.

    ``init`` and ``update`` are optax's own (same state tree, so checkpoints are interchangeable
    with the unfused optimizer). ``apply(grads, state, params, accept, grad_norm=None)`` does the
    clipping, both moments, bias correction, decay and the parameter update in one elementwise
    function per parameter, the non-finite guard (``accept``) included, and returns
    ``(new_params, new_state)``. The bias corrections and the clip factor are folded into scalars
    first, as torch's AdamW does, so each element costs one sqrt and one division where optax's
    formula divides four times; the result equals ``update`` + ``apply_updates`` to float32
    rounding (tests/test_optim.py). SmolLM2-135M, 4 x 128 tokens: the update's fusions took 0.244
    instead of 0.338 thread-seconds per step (`benchmarks/profile_step.py`, 2026-12-04), and
    0.140 instead of 0.211 once the moments stopped being copied (the barrier in ``apply``; the
    step's wall time did not move beyond noise: the copies ran beside the forward pass).
    """

    init: Any
    update: Any
    apply: Any


def _only(state: Any, kind: type) -> Any:
    """The one node of optax's public state type `kind` in an optimizer state, found by its type
    rather than its position in optax's chain (which is optax's to change)."""
    is_kind = lambda x: isinstance(x, kind)  # noqa: E731
    found = [x for x in jax.tree.leaves(state, is_leaf=is_kind) if is_kind(x)]
    if len(found) != 1:
        raise TypeError(f"expected one {kind.__name__} in the optimizer state, found {len(found)}")
    return found[0]


def _swap(state: Any, kind: type, new: Any) -> Any:
    """`state` with its `kind` node (see `_only`) replaced by `new`."""
    is_kind = lambda x: isinstance(x, kind)  # noqa: E731
    return jax.tree.map(lambda x: new if is_kind(x) else x, state, is_leaf=is_kind)


def _saturating_increment(count: jax.Array) -> jax.Array:
    """count + 1, staying at the dtype's maximum instead of wrapping (as optax's counters)."""
    return jnp.where(count < jnp.iinfo(count.dtype).max, count + 1, count)


def _one_after_another(leaf, params, grads, mu, nu, decays, params_on_host=False):
    """``jax.tree.map(leaf, ...)`` over host-resident moments (and parameters, with
    ``params_on_host``), streamed: each parameter's are copied to the device only once the
    previous parameter's results exist (an optimization barrier orders them), updated there, and
    copied back to the host."""
    flat_p, treedef = jax.tree.flatten(params)
    flat_g, flat_m, flat_v, flat_d = (treedef.flatten_up_to(t) for t in (grads, mu, nu, decays))
    out, previous = [], None
    for p, g, m, v, decay in zip(flat_p, flat_g, flat_m, flat_v, flat_d, strict=True):
        if previous is not None:
            p, m, v, _ = jax.lax.optimization_barrier((p, m, v, previous))
        if params_on_host:
            p = jax.device_put(p, jax.memory.Space.Device)
        m, v = jax.device_put((m, v), jax.memory.Space.Device)
        new_p, new_m, new_v = leaf(p, g.astype(p.dtype), m, v, decay)
        new_m, new_v = jax.device_put((new_m, new_v), jax.memory.Space.Host)
        if params_on_host:
            new_p = jax.device_put(new_p, jax.memory.Space.Host)
        previous = (new_p, new_m, new_v)
        out.append((new_p, new_m, new_v))
    return jax.tree.unflatten(treedef, out)


def fused_adamw(
    schedule: optax.Schedule,
    *,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    max_grad_norm: float | None,
) -> FusedAdamW:
    """AdamW (decoupled decay scaled by the learning rate, `weight_decay_mask`) with optional
    global-norm clipping; see `FusedAdamW`."""
    mask = weight_decay_mask if weight_decay > 0 else None
    reference = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
    if max_grad_norm is not None:
        reference = optax.chain(optax.clip_by_global_norm(max_grad_norm), reference)

    def apply(grads, state, params, accept, grad_norm=None, offload=False, params_on_host=False):
        """One update: (new_params, new_state); both unchanged where ``accept`` is False.

        ``offload``: the moments arrive in host memory and go back there. Each parameter's pair
        is copied to the device, updated and copied back one parameter after the other (each
        copy waits for the previous parameter's results), so that all the moments need not be on
        the device at once (how many are is XLA's scheduling: benchmarks/README.md, 2026-12-06). ``params_on_host``: the parameters too (and
        the gradients may come in a lower dtype: each is cast to its parameter's dtype there).
        """
        keep = lambda new, old: jnp.where(accept, new, old)  # noqa: E731
        adam_state = _only(state, optax.ScaleByAdamState)
        schedule_state = _only(state, optax.ScaleByScheduleState)
        if offload:  # the step counts come to the device (the moments, one by one, below)
            to_device = lambda x: jax.device_put(x, jax.memory.Space.Device)  # noqa: E731
            adam_state = adam_state._replace(count=to_device(adam_state.count))
            schedule_state = schedule_state._replace(count=to_device(schedule_state.count))
        count = _saturating_increment(adam_state.count)
        correction1 = 1 - jnp.asarray(b1, jnp.float32) ** count
        correction2 = 1 - jnp.asarray(b2, jnp.float32) ** count
        step_size = -jnp.asarray(schedule(schedule_state.count), jnp.float32)
        # Scalars first, so the per-element work is one sqrt, one division and a few FMAs (as
        # torch's AdamW): u = lr/c1 * m / (sqrt(v)/sqrt(c2) + eps).
        scale = jnp.float32(1.0)
        if max_grad_norm is not None:
            norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
            scale = jnp.where(norm < max_grad_norm, 1.0, max_grad_norm / norm)
        inv_sqrt_c2 = jax.lax.rsqrt(correction2)
        lr_c1 = step_size / correction1
        decays = weight_decay_mask(params) if mask else jax.tree.map(lambda _: False, params)

        def leaf(p, g, m, v, decay):
            g = g * scale.astype(g.dtype)
            m_new = keep(((1 - b1) * g + b1 * m).astype(m.dtype), m)
            v_new = keep(((1 - b2) * (g * g) + b2 * v).astype(v.dtype), v)
            # Without the barrier XLA:CPU fuses the moments' arithmetic into the parameter's
            # update too, so three loop fusions read the old moments; one of them writes each
            # moment in place (its buffer is donated), so XLA copied both moments first. Through
            # the barrier the parameter reads the new moments, the old ones have one reader each,
            # and nothing is copied: SmolLM2 moves 40 instead of 60 bytes per parameter a step.
            m_new, v_new = jax.lax.optimization_barrier((m_new, v_new))
            u = (
                lr_c1.astype(m.dtype)
                * m_new
                / (jnp.sqrt(v_new) * inv_sqrt_c2.astype(v.dtype) + eps)
            )
            if decay:
                u = u + (step_size * weight_decay).astype(p.dtype) * p
            return keep((p + u).astype(p.dtype), p), m_new, v_new

        if offload:
            out = _one_after_another(
                leaf, params, grads, adam_state.mu, adam_state.nu, decays, params_on_host
            )
        else:
            out = jax.tree.map(leaf, params, grads, adam_state.mu, adam_state.nu, decays)
        is_triple = lambda x: isinstance(x, tuple) and len(x) == 3  # noqa: E731
        pick = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=is_triple)  # noqa: E731
        new_adam = adam_state._replace(count=keep(count, adam_state.count), mu=pick(1), nu=pick(2))
        new_schedule = schedule_state._replace(
            count=keep(_saturating_increment(schedule_state.count), schedule_state.count)
        )
        new_state = _swap(state, optax.ScaleByAdamState, new_adam)
        return pick(0), _swap(new_state, optax.ScaleByScheduleState, new_schedule)

    return FusedAdamW(reference.init, reference.update, apply)


def build_optimizer(optim: OptimSection, total_steps: int) -> optax.GradientTransformation:
    """The optax transformation of a run: clipping (if set), then the optimizer with its schedule.

    adamw comes as a `FusedAdamW` (optax's transformation plus the train step's fused update).

    Weight decay is decoupled and scaled by the learning rate for adamw, lion and adafactor (as in
    torch's AdamW), an L2 term added to the gradient for sgd; `weight_decay_mask` picks where.
    Adafactor is used without parameter-scale multiplication, so learning_rate is an absolute
    step size as for the others.
    """
    schedule = build_schedule(optim, total_steps)
    decay = optim.weight_decay
    mask = weight_decay_mask if decay > 0 else None
    beta2 = optim.beta2 if optim.beta2 is not None else _DEFAULT_BETA2.get(optim.name)
    if optim.name == "adamw":
        return fused_adamw(
            schedule,
            b1=optim.beta1,
            b2=beta2,
            eps=optim.eps,
            weight_decay=decay,
            max_grad_norm=optim.max_grad_norm,
        )
    if optim.name == "lion":
        tx = optax.lion(schedule, b1=optim.beta1, b2=beta2, weight_decay=decay, mask=mask)
    elif optim.name == "adafactor":
        # optax.adafactor adds its weight decay after the learning rate (not scaled by it), so the
        # same pieces are chained here with the decay before the learning rate, like adamw.
        parts = [optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0)]
        if decay > 0:
            parts.append(optax.add_decayed_weights(decay, mask))
        tx = optax.chain(*parts, optax.scale_by_learning_rate(schedule))
    elif optim.name == "sgd":
        momentum = optim.momentum if optim.momentum > 0 else None
        tx = optax.sgd(schedule, momentum=momentum)
        if decay > 0:
            tx = optax.chain(optax.add_decayed_weights(decay, mask), tx)
    else:
        raise ConfigError(f"optim.name={optim.name!r}: use adamw, adafactor, lion or sgd")
    if optim.max_grad_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(optim.max_grad_norm), tx)
    return tx


def constant_rate(optim: OptimSection) -> OptimSection:
    """`optim` with a constant learning rate and no warmup. Its optimizer has the same state
    layout as the run's for any run length, for restoring or evaluating a run whose length is not
    known (an export, an evaluation); never for training, since the schedule is not the run's."""
    return optim.replace(schedule="constant", warmup_steps=0, warmup_ratio=0.0)
