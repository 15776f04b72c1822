"""Golden values and properties of the reward losses and metrics (rewardax.losses)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rewardax import losses
from rewardax.errors import DataError


def softplus(x: float) -> float:
    """-log σ(x) = log(1 + e^-x), written out for the golden values."""
    return math.log1p(math.exp(-x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_bradley_terry_golden_values_without_margin():
    chosen = jnp.array([1.0, 0.0, 2.0, -3.0])
    rejected = jnp.array([0.5, 0.0, -1.0, 1.0])
    got = losses.bradley_terry_loss(chosen, rejected)
    # differences 0.5, 0, 3, -4: -log σ(0.5) = log(1 + e^-0.5) = 0.4740770, -log σ(0) = log 2.
    expected = [0.47407698418010663, math.log(2.0), softplus(3.0), softplus(-4.0)]
    assert got.shape == (4,)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert softplus(-4.0) == pytest.approx(4.0181499279)


def test_bradley_terry_golden_values_with_margin():
    chosen = jnp.array([1.0, 1.0])
    rejected = jnp.array([0.5, 0.5])
    margin = jnp.array([1.0, 0.0])
    got = losses.bradley_terry_loss(chosen, rejected, margin)
    # 1 - 0.5 - 1 = -0.5: -log σ(-0.5) = log(1 + e^0.5) = 0.9740770; no margin: 0.4740770.
    np.testing.assert_allclose(got, [0.97407698418010663, 0.47407698418010663], rtol=1e-6)


def test_bradley_terry_is_stable_for_large_differences():
    got = losses.bradley_terry_loss(jnp.array([200.0, -200.0]), jnp.array([0.0, 0.0]))
    # -log σ(200) underflows to 0 (not log(0) = inf); -log σ(-200) = 200 exactly in float32.
    np.testing.assert_allclose(got, [0.0, 200.0], atol=1e-6)
    assert bool(jnp.all(jnp.isfinite(got)))


def test_bradley_terry_upcasts_bfloat16_rewards():
    chosen = jnp.array([1.0], jnp.bfloat16)
    got = losses.bradley_terry_loss(chosen, jnp.array([0.5], jnp.bfloat16))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, [softplus(0.5)], rtol=1e-6)


def test_margin_changes_the_gradient_by_the_expected_amount():
    chosen = jnp.array([1.0, -0.5, 2.0])
    rejected = jnp.array([0.5, 0.5, 2.5])
    margin = jnp.array([1.0, 2.0, 0.0])

    def total(c, r, m):
        return jnp.sum(losses.bradley_terry_loss(c, r, m))

    grad_with = jax.grad(total, argnums=(0, 1))(chosen, rejected, margin)
    grad_without = jax.grad(total, argnums=(0, 1))(chosen, rejected, None)
    # d/dr_c [-log σ(d)] = σ(d) - 1 with d = r_c - r_r - m; d/dr_r is its negative.
    d_with = [1.0 - 0.5 - 1.0, -0.5 - 0.5 - 2.0, 2.0 - 2.5 - 0.0]
    d_without = [0.5, -1.0, -0.5]
    np.testing.assert_allclose(grad_with[0], [sigmoid(d) - 1 for d in d_with], rtol=1e-6)
    np.testing.assert_allclose(grad_with[1], [1 - sigmoid(d) for d in d_with], rtol=1e-6)
    np.testing.assert_allclose(grad_without[0], [sigmoid(d) - 1 for d in d_without], rtol=1e-6)
    # The first two pairs have a margin, so their gradient must differ; the third has none.
    assert abs(float(grad_with[0][0] - grad_without[0][0])) > 0.1
    assert abs(float(grad_with[0][1] - grad_without[0][1])) > 0.1
    assert float(grad_with[0][2]) == pytest.approx(float(grad_without[0][2]))


@pytest.mark.parametrize("shape", [(3, 1), (1, 3), (2,)])
def test_margin_of_the_wrong_shape_is_rejected(shape):
    chosen = jnp.zeros(3)
    with pytest.raises(DataError, match=r"margin has shape"):
        losses.bradley_terry_loss(chosen, chosen, jnp.zeros(shape))
    # Also when traced (the check uses static shapes, so it fires at trace time).
    with pytest.raises(DataError, match=r"\[B, B\]"):
        jax.jit(losses.bradley_terry_loss)(chosen, chosen, jnp.zeros(shape))


def test_rewards_must_be_vectors_of_the_same_length():
    with pytest.raises(DataError, match="chosen_rewards"):
        losses.bradley_terry_loss(jnp.zeros((3, 1)), jnp.zeros(3))
    with pytest.raises(DataError, match="rejected_rewards"):
        losses.pairwise_accuracy(jnp.zeros(3), jnp.zeros(4))


def test_centering_penalty_golden_values():
    got = losses.centering_penalty(jnp.array([1.0, -2.0, 3.0]), jnp.array([0.5, 2.0, -1.0]))
    # (1 + 0.5)² = 2.25, (-2 + 2)² = 0, (3 - 1)² = 4.
    np.testing.assert_allclose(got, [2.25, 0.0, 4.0])


def test_accuracy_counts_ties_as_half():
    got = losses.pairwise_accuracy(jnp.array([2.0, 1.0, 0.0, 0.0]), jnp.array([1.0, 1.0, 3.0, 0.0]))
    np.testing.assert_array_equal(got, [1.0, 0.5, 0.0, 0.5])


def test_masked_mean_ignores_padding_even_nan():
    values = jnp.array([1.0, 3.0, jnp.nan, 100.0])
    mask = jnp.array([1.0, 1.0, 0.0, 0.0])
    assert float(losses.masked_mean(values, mask)) == pytest.approx(2.0)
    assert float(losses.masked_mean(values, jnp.zeros(4))) == 0.0  # no real pair: 0, not NaN


CHOSEN = [1.0, 0.0, 2.0]
REJECTED = [0.5, 0.0, -1.0]


def test_reward_loss_and_metrics_golden_values_with_centering():
    loss, metrics = losses.reward_loss_and_metrics(
        jnp.array(CHOSEN), jnp.array(REJECTED), None, jnp.ones(3), center_coefficient=0.1
    )
    bt = (softplus(0.5) + math.log(2.0) + softplus(3.0)) / 3  # (0.474077 + 0.693147 + 0.048587)/3
    center = (2.25 + 0.0 + 1.0) / 3  # (1.5², 0², 1²) / 3
    assert bt == pytest.approx(0.4052703, abs=1e-6)
    expected_loss = bt + 0.1 * center  # 0.405270 + 0.108333 = 0.513604
    all_rewards = CHOSEN + REJECTED
    mean = sum(all_rewards) / 6  # 2.5 / 6
    std = math.sqrt(sum((r - mean) ** 2 for r in all_rewards) / 6)  # population std = 0.931695
    assert float(loss) == pytest.approx(expected_loss, rel=1e-6)
    expected = {
        "loss": expected_loss,
        "accuracy": (1 + 0.5 + 1) / 3,
        "margin": (0.5 + 0.0 + 3.0) / 3,
        "chosen_reward": 1.0,
        "rejected_reward": -0.5 / 3,
        "reward_std": std,
        "num_pairs": 3.0,
    }
    assert set(metrics) == set(expected)
    for name, value in expected.items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert std == pytest.approx(0.9316950, abs=1e-6)


def test_reward_loss_without_centering_is_the_mean_bradley_terry_loss():
    loss, _ = losses.reward_loss_and_metrics(
        jnp.array(CHOSEN), jnp.array(REJECTED), jnp.array([0.5, 0.0, 0.0]), jnp.ones(3)
    )
    # margin 0.5 on the first pair: d = 0, so its loss is log 2.
    assert float(loss) == pytest.approx((2 * math.log(2.0) + softplus(3.0)) / 3, rel=1e-6)


def test_padding_pairs_change_neither_loss_metrics_nor_gradients():
    real = losses.reward_loss_and_metrics(
        jnp.array(CHOSEN), jnp.array(REJECTED), jnp.array([0.2, 0.0, 1.0]), jnp.ones(3), 0.05
    )
    padded_chosen = jnp.array([*CHOSEN, 50.0, -7.0])
    padded_rejected = jnp.array([*REJECTED, -50.0, jnp.nan])
    padded = losses.reward_loss_and_metrics(
        padded_chosen,
        padded_rejected,
        jnp.array([0.2, 0.0, 1.0, 9.0, 9.0]),
        jnp.array([1.0, 1.0, 1.0, 0.0, 0.0]),
        0.05,
    )
    assert float(padded[0]) == pytest.approx(float(real[0]), rel=1e-6)
    for name in real[1]:
        assert float(padded[1][name]) == pytest.approx(float(real[1][name]), rel=1e-6), name

    def loss_of(c, r, mask):
        return losses.reward_loss_and_metrics(c, r, None, mask, 0.05)[0]

    grads = jax.grad(loss_of, argnums=(0, 1))(
        padded_chosen.at[4].set(1.0), padded_rejected.at[4].set(1.0), jnp.array([1, 1, 1, 0, 0.0])
    )
    np.testing.assert_array_equal(grads[0][3:], [0.0, 0.0])
    np.testing.assert_array_equal(grads[1][3:], [0.0, 0.0])


def test_sums_over_microbatches_equal_one_large_batch():
    rng = np.random.default_rng(0)
    chosen, rejected, margin = (jnp.asarray(rng.normal(size=8), jnp.float32) for _ in range(3))
    mask = jnp.array([1, 1, 1, 1, 1, 1, 0, 0], jnp.float32)  # a last partial batch
    _, whole = losses.reward_loss_and_metrics(chosen, rejected, margin, mask, 0.01)
    parts = [
        losses.reward_metric_sums(chosen[s], rejected[s], margin[s], mask[s], 0.01)
        for s in (slice(0, 3), slice(3, 8))
    ]
    summed = jax.tree.map(lambda a, b: a + b, *parts)
    finished = losses.metrics_from_sums(summed)
    for name, value in whole.items():
        np.testing.assert_allclose(finished[name], value, rtol=1e-5, err_msg=name)
