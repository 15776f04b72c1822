"""Schedules, optimizers, clipping and the weight-decay mask (rewardax.optim)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rewardax.config import OptimSection
from rewardax.errors import ConfigError
from rewardax.optim import (
    build_optimizer,
    build_schedule,
    resolve_warmup_steps,
    weight_decay_mask,
)

PEAK, FINAL = 2e-5, 1e-6


def values(schedule, steps):
    return [float(schedule(step)) for step in steps]


def test_linear_schedule_matches_the_hugging_face_recipe():
    # 80 steps, 5 warmup, lr 2e-5 (the benchmark recipe): HF's linear schedule with warmup is
    # lr·step/5 during warmup, then lr·(80 - step)/(80 - 5).
    schedule = build_schedule(OptimSection(learning_rate=PEAK, warmup_steps=5), 80)
    steps = [0, 1, 4, 5, 6, 40, 79, 80]
    expected = [PEAK * s / 5 if s < 5 else PEAK * (80 - s) / 75 for s in steps]
    np.testing.assert_allclose(values(schedule, steps), expected, rtol=1e-5, atol=1e-12)


def test_linear_schedule_ends_at_the_final_learning_rate():
    optim = OptimSection(learning_rate=PEAK, warmup_steps=5, final_learning_rate=FINAL)
    schedule = build_schedule(optim, 85)
    got = values(schedule, [0, 5, 45, 85, 200])
    # decay over 80 steps; step 45 is half way: (2e-5 + 1e-6) / 2 = 1.05e-5.
    np.testing.assert_allclose(got, [0.0, PEAK, (PEAK + FINAL) / 2, FINAL, FINAL], rtol=1e-5)


def test_cosine_schedule_values():
    optim = OptimSection(
        learning_rate=PEAK, schedule="cosine", warmup_steps=5, final_learning_rate=FINAL
    )
    schedule = build_schedule(optim, 85)
    got = values(schedule, [0, 3, 5, 25, 45, 85])
    # After warmup: FINAL + (PEAK - FINAL)·½(1 + cos(π·t/80)); t = 20 -> ½(1 + cos(π/4)) = 0.853553.
    quarter = FINAL + (PEAK - FINAL) * 0.5 * (1 + math.cos(math.pi / 4))
    expected = [0.0, PEAK * 3 / 5, PEAK, quarter, (PEAK + FINAL) / 2, FINAL]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-12)
    assert 0.5 * (1 + math.cos(math.pi / 4)) == pytest.approx(0.8535534)


def test_constant_schedule_with_and_without_warmup():
    warm = build_schedule(OptimSection(learning_rate=1e-3, schedule="constant", warmup_steps=4), 10)
    np.testing.assert_allclose(values(warm, [0, 2, 4, 9, 10]), [0, 5e-4, 1e-3, 1e-3, 1e-3])
    flat = build_schedule(OptimSection(learning_rate=1e-3, schedule="constant"), 10)
    np.testing.assert_allclose(values(flat, [0, 10]), [1e-3, 1e-3])


def test_no_warmup_starts_at_the_peak():
    schedule = build_schedule(OptimSection(learning_rate=1e-3, schedule="linear"), 10)
    np.testing.assert_allclose(values(schedule, [0, 5, 10]), [1e-3, 5e-4, 0.0], atol=1e-10)


def test_warmup_ratio_rounds_up():
    optim = OptimSection(learning_rate=1e-3, warmup_ratio=0.1)
    assert resolve_warmup_steps(optim, 85) == 9  # ceil(8.5)
    schedule = build_schedule(optim, 85)
    assert float(schedule(8)) < 1e-3
    assert float(schedule(9)) == pytest.approx(1e-3)


def test_impossible_schedules_are_config_errors():
    with pytest.raises(ConfigError, match="warmup_steps=20 is more than the 10"):
        build_schedule(OptimSection(warmup_steps=20), 10)
    with pytest.raises(ConfigError, match="at least 1"):
        build_schedule(OptimSection(), 0)
    with pytest.raises(ConfigError, match=r"optim\.name must be one of 'adamw', 'adafactor'"):
        build_optimizer(OptimSection(name="adam"), 10)  # refused by the section already


def quadratic(params):
    target = jnp.arange(12.0).reshape(3, 4) / 10
    return jnp.sum((params["w"] - target) ** 2) + jnp.sum((params["b"] - 1.0) ** 2)


@pytest.mark.parametrize(
    ("name", "lr", "extra"),
    [
        ("adamw", 0.05, {"weight_decay": 0.01}),
        ("adafactor", 0.05, {"weight_decay": 0.01}),
        ("lion", 0.03, {"weight_decay": 0.01}),
        ("sgd", 0.1, {"momentum": 0.9}),
    ],
)
def test_each_optimizer_lowers_a_quadratic(name, lr, extra):
    optim = OptimSection(name=name, learning_rate=lr, schedule="constant", **extra)
    tx = build_optimizer(optim, 100)
    params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(quadratic)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    start = float(quadratic(params))
    for _ in range(60):
        params, state = step(params, state)
    assert float(quadratic(params)) < 0.05 * start, name


def test_clipping_bounds_the_update():
    params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    grads = {"w": jnp.full((2, 2), 500.0), "b": jnp.full(2, 500.0)}  # global norm ≈ 1224.7

    def update_norm(max_grad_norm):
        optim = OptimSection(
            name="sgd", learning_rate=1.0, schedule="constant", max_grad_norm=max_grad_norm
        )
        tx = build_optimizer(optim, 10)
        updates, _ = tx.update(grads, tx.init(params), params)
        return float(optax.tree.norm(updates))

    assert update_norm(1.0) == pytest.approx(1.0, rel=1e-5)
    assert update_norm(None) == pytest.approx(500.0 * math.sqrt(6), rel=1e-5)


def test_weight_decay_mask_on_a_dict():
    params = {
        "embed": jnp.ones((5, 4)),
        "layer": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)},
        "input_layernorm": {"weight": jnp.ones((4, 4))},  # 2-D but named norm: no decay
        "final_norm": {"scale": jnp.ones(4)},
        "score": {"w": jnp.ones((4, 1)), "gain": jnp.ones(4)},  # 1-D without a name: no decay
    }
    mask = weight_decay_mask(params)
    assert mask == {
        "embed": True,
        "layer": {"kernel": True, "bias": False},
        "input_layernorm": {"weight": False},
        "final_norm": {"scale": False},
        "score": {"w": True, "gain": False},
    }


def test_weight_decay_mask_on_an_nnx_state():
    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(3, 4, rngs=rngs)
            self.norm = nnx.RMSNorm(4, rngs=rngs)

    _, params, _ = nnx.split(Tiny(nnx.Rngs(0)), nnx.Param, ...)
    mask = weight_decay_mask(params)
    flat = {
        jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(mask)
    }
    assert flat == {
        "['dense']['bias'].value": False,
        "['dense']['kernel'].value": True,
        "['norm']['scale'].value": False,
    }


@pytest.mark.parametrize("name", ["adamw", "adafactor", "lion", "sgd"])
def test_weight_decay_is_lr_times_decay_and_skips_masked_parameters(name):
    # With zero gradients, the only update is weight decay: -lr·wd·p on decayed parameters.
    optim = OptimSection(
        name=name, learning_rate=0.1, weight_decay=0.5, schedule="constant", max_grad_norm=None
    )
    tx = build_optimizer(optim, 10)
    params = {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full(3, 2.0)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["kernel"], np.full((2, 3), -0.1 * 0.5 * 2.0), rtol=1e-6)
    np.testing.assert_array_equal(updates["bias"], np.zeros(3))


@pytest.mark.parametrize(("weight_decay", "max_grad_norm"), [(0.0, 1.0), (0.1, 0.5), (0.01, None)])
def test_fused_adamw_update_equals_optax(weight_decay, max_grad_norm):
    # The train step's fused update (FusedAdamW.apply) against optax's update + apply_updates
    # over 6 steps of large random gradients (so clipping is active where set), with a decayed
    # kernel and an undecayed bias; the state trees must stay the same structure (checkpoints).
    optim = OptimSection(
        name="adamw",
        learning_rate=1e-2,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        schedule="linear",
        warmup_steps=2,
    )
    tx = build_optimizer(optim, 10)
    key = jax.random.PRNGKey(0)
    params = {
        "w": jax.random.normal(key, (4, 5)),
        "layer": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)},
    }
    ref_params = fused_params = params
    ref_state = fused_state = tx.init(params)
    apply = jax.jit(tx.apply)
    for i in range(6):
        grads = jax.tree.map(
            lambda x, i=i: 3.0 * jax.random.normal(jax.random.fold_in(key, i), x.shape), params
        )
        updates, ref_state = tx.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        fused_params, fused_state = apply(grads, fused_state, fused_params, jnp.bool_(True))
    assert jax.tree.structure(fused_state) == jax.tree.structure(ref_state)
    for ref, fused in zip(
        jax.tree.leaves((ref_params, ref_state)),
        jax.tree.leaves((fused_params, fused_state)),
        strict=True,
    ):
        np.testing.assert_allclose(fused, ref, rtol=1e-5, atol=1e-6)
    # The parameters moved (the comparison above is not between two unchanged trees).
    assert float(jnp.max(jnp.abs(fused_params["w"] - params["w"]))) > 1e-3


def test_fused_adamw_rejected_step_changes_nothing():
    optim = OptimSection(name="adamw", learning_rate=1e-2, weight_decay=0.1, schedule="constant")
    tx = build_optimizer(optim, 10)
    params = {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5), params)
    state = tx.init(params)
    params, state = tx.apply(grads, state, params, jnp.bool_(True))
    new_params, new_state = tx.apply(grads, state, params, jnp.bool_(False))
    for old, new in zip(
        jax.tree.leaves((params, state)), jax.tree.leaves((new_params, new_state)), strict=True
    ):
        np.testing.assert_array_equal(new, old)
