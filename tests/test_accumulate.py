"""Gradient accumulation inside the backward pass (`rewardax.models.accumulate`): the step's
summed gradients equal the plain sum of each microbatch's, for every kind of parameter."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rewardax.models import accumulate, lora
from rewardax.models.kernels import select_kernels
from rewardax.models.reward import RewardModel
from rewardax.state import RewardState
from rewardax.steps import make_train_step
from test_steps import TINY, random_batch


def test_gradient_into_adds_the_accumulator_to_the_gradient():
    w = jnp.array([1.0, -2.0, 0.5])
    acc = jnp.array([10.0, 20.0, 30.0])

    def loss(w, acc):
        return jnp.sum(jnp.sin(accumulate.gradient_into(w, acc)) * jnp.array([1.0, 2.0, 3.0]))

    value = loss(w, acc)
    np.testing.assert_allclose(value, jnp.sum(jnp.sin(w) * jnp.array([1.0, 2.0, 3.0])))
    own = jnp.cos(w) * jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(jax.grad(loss, argnums=1)(w, acc), acc + own, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(loss, argnums=0)(w, acc), own, rtol=1e-6)
    # A bf16 value's gradient is added to a float32 accumulator in float32.
    g = jax.grad(lambda a: jnp.sum(accumulate.gradient_into(w.astype(jnp.bfloat16), a)))(acc)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, acc + 1.0)


def test_embed_into_scatter_adds_the_rows_used():
    table = jnp.arange(12.0).reshape(4, 3)
    ids = jnp.array([[1, 1, 3], [0, 1, 1]])
    acc = jnp.full((4, 3), 0.25)
    weights = jnp.arange(18.0).reshape(2, 3, 3)
    rows = accumulate.embed_into(table, ids, acc)
    np.testing.assert_array_equal(rows, table[ids])
    grad = jax.grad(lambda a: jnp.sum(accumulate.embed_into(table, ids, a) * weights))(acc)
    dense = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * weights))(table)
    np.testing.assert_allclose(grad, acc + dense)
    assert float(dense[1, 0]) == 0.0 + 3.0 + 12.0 + 15.0  # row 1 read four times: all summed


def test_an_accumulator_leaf_with_no_parameter_is_refused():
    model = RewardModel(TINY, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    extra = nnx.State({"model": {"layers": {"nonexistent": {"kernel": jnp.zeros((2, 3))}}}})
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"layers has no parameter at nonexistent\.kernel"):
        model(ids, grad_accumulator=extra)
    with pytest.raises(ValueError, match="the reward model has no parameters head"):
        model(ids, grad_accumulator=nnx.State({"head": params["score"]}))


def _step_update(model_fn, batch, accumulation_steps, in_backward, *, dropout=False):
    """One SGD(1) step's parameter change: minus the accumulated gradient, per leaf."""
    model = model_fn()
    kernels = dataclasses.replace(model.resolved_kernels(), accumulate_in_backward=in_backward)
    model.kernels = kernels
    state = RewardState.create(model, optax.sgd(1.0))
    step = jax.jit(
        make_train_step(
            state.graphdef,
            optax.sgd(1.0),
            optax.constant_schedule(1.0),
            accumulation_steps=accumulation_steps,
            dropout=dropout,
        )
    )
    arrays, metrics = step(state.arrays(), batch)
    before = dict(nnx.to_flat_state(state.params))
    after = dict(nnx.to_flat_state(arrays["params"]))
    update = {
        path: np.asarray(after[path][...], np.float64) - np.asarray(before[path][...], np.float64)
        for path in before
    }
    return update, metrics


def _llama(**kwargs):
    return lambda: RewardModel(TINY, rngs=nnx.Rngs(0), kernels=select_kernels("xla"), **kwargs)


def _llama_lora():
    model = _llama()()
    return lora.add_adapters(model, rank=4, alpha=8.0, seed=1)


def _llama_splash():
    return RewardModel(
        TINY, rngs=nnx.Rngs(0), kernels=select_kernels("pallas"), remat_policy="save_attention"
    )


CASES = {
    # name: (model, rtol, dropout)
    "float32": (_llama(), 1e-5, False),
    "bfloat16_parameters": (_llama(param_dtype="bfloat16"), 1e-2, False),
    "remat_full": (_llama(remat_policy="full"), 1e-5, False),
    "lora": (_llama_lora, 1e-5, False),
    "dropout": (_llama(dropout_rate=0.2), 1e-5, True),
    "splash_save_attention": (_llama_splash, 1e-5, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_accumulating_in_the_backward_pass_equals_adding_after_it(case, monkeypatch):
    model_fn, rtol, dropout = CASES[case]
    batch = random_batch(np.random.default_rng(3), 8)
    batch["pair_mask"][5] = 0.0
    routed = []  # the parameters that went through gradient_into, as traced
    gradient_into = accumulate.gradient_into

    def spy(value, accumulator):
        routed.append(value.shape)
        return gradient_into(value, accumulator)

    monkeypatch.setattr(accumulate, "gradient_into", spy)
    fused, fused_metrics = _step_update(model_fn, batch, 4, True, dropout=dropout)
    # Every parameter but the embedding (scatter-added by embed_into) went through it.
    assert len(routed) == len(fused) - (case != "lora")
    routed.clear()
    plain, plain_metrics = _step_update(model_fn, batch, 4, False, dropout=dropout)
    assert not routed
    assert fused.keys() == plain.keys()
    if case == "lora":  # adapters and the score head, nothing else
        assert {p[-1] for p in fused} == {"lora_a", "lora_b", "kernel"}
    for path, expected in plain.items():
        name = ".".join(map(str, path))
        if "lora_a" not in name:  # lora_b starts at 0, so lora_a's first gradient is 0
            assert np.abs(expected).max() > 1e-6, name  # every parameter really moved
        scale = np.abs(expected).max()
        np.testing.assert_allclose(
            fused[path], expected, rtol=rtol, atol=rtol * scale, err_msg=name
        )
    for key in ("loss", "accuracy", "grad_norm", "num_pairs"):
        np.testing.assert_allclose(fused_metrics[key], plain_metrics[key], rtol=max(rtol, 1e-6))


def test_tpu_and_gpu_kernels_accumulate_in_the_backward_pass_and_the_cpu_does_not():
    assert select_kernels("auto", "tpu").accumulate_in_backward
    assert select_kernels("auto", "gpu").accumulate_in_backward
    assert not select_kernels("auto", "cpu").accumulate_in_backward
