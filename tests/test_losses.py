"""Golden values and properties of the reward losses and metrics (rewardax.losses)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rewardax import losses
from rewardax.errors import ConfigError, DataError
from tolerances import F32_RTOL


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
    np.testing.assert_allclose(got, expected, rtol=F32_RTOL)
    assert softplus(-4.0) == pytest.approx(4.0181499279)


def test_bradley_terry_golden_values_with_margin():
    chosen = jnp.array([1.0, 1.0])
    rejected = jnp.array([0.5, 0.5])
    margin = jnp.array([1.0, 0.0])
    got = losses.bradley_terry_loss(chosen, rejected, margin)
    # 1 - 0.5 - 1 = -0.5: -log σ(-0.5) = log(1 + e^0.5) = 0.9740770; no margin: 0.4740770.
    np.testing.assert_allclose(got, [0.97407698418010663, 0.47407698418010663], rtol=F32_RTOL)


def test_bradley_terry_is_stable_for_large_differences():
    got = losses.bradley_terry_loss(jnp.array([200.0, -200.0]), jnp.array([0.0, 0.0]))
    # -log σ(200) underflows to 0 (not log(0) = inf); -log σ(-200) = 200 exactly in float32.
    np.testing.assert_allclose(got, [0.0, 200.0], atol=1e-6)
    assert bool(jnp.all(jnp.isfinite(got)))


def test_bradley_terry_upcasts_bfloat16_rewards():
    chosen = jnp.array([1.0], jnp.bfloat16)
    got = losses.bradley_terry_loss(chosen, jnp.array([0.5], jnp.bfloat16))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, [softplus(0.5)], rtol=F32_RTOL)


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
    np.testing.assert_allclose(grad_with[0], [sigmoid(d) - 1 for d in d_with], rtol=F32_RTOL)
    np.testing.assert_allclose(grad_with[1], [1 - sigmoid(d) for d in d_with], rtol=F32_RTOL)
    np.testing.assert_allclose(grad_without[0], [sigmoid(d) - 1 for d in d_without], rtol=F32_RTOL)
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


# The training objective is `reward_metric_sums` (per microbatch) + `metrics_from_sums` (once per
# step), as `rewardax.steps` calls them. Three real pairs and one padding pair:
CHOSEN = [1.0, 0.0, 2.0, 50.0]
REJECTED = [0.5, 0.0, -1.0, np.nan]
MARGIN = [0.5, 0.0, 1.0, 9.0]
PAIR_MASK = [1.0, 1.0, 1.0, 0.0]


def objective(chosen, rejected, margin, mask, center):
    sums = losses.reward_metric_sums(
        jnp.asarray(chosen, jnp.float32),
        jnp.asarray(rejected, jnp.float32),
        None if margin is None else jnp.asarray(margin, jnp.float32),
        jnp.asarray(mask, jnp.float32),
        center,
    )
    return sums, losses.metrics_from_sums(sums)


def test_objective_golden_values_with_margin_and_centering():
    sums, metrics = objective(CHOSEN, REJECTED, MARGIN, PAIR_MASK, center=0.1)
    # d = r_c - r_r - m over the real pairs: 1 - 0.5 - 0.5 = 0, 0 - 0 - 0 = 0, 2 + 1 - 1 = 2.
    bt = [math.log(2.0), math.log(2.0), softplus(2.0)]  # 0.693147, 0.693147, 0.126928
    center = [1.5**2, 0.0**2, 1.0**2]  # (r_c + r_r)²: 2.25, 0, 1
    loss_sum = sum(bt) + 0.1 * sum(center)  # 1.513222 + 0.325 = 1.838222
    assert loss_sum == pytest.approx(1.838222, abs=1e-6)
    real = [1.0, 0.0, 2.0, 0.5, 0.0, -1.0]  # the 2·3 real rewards
    mean = sum(real) / 6  # 2.5 / 6 = 0.416667
    second_moment = sum(r * r for r in real) / 6  # (1 + 0 + 4 + 0.25 + 0 + 1) / 6 = 1.041667
    std = math.sqrt(second_moment - mean**2)  # sqrt(1.041667 - 0.173611) = 0.931695
    assert std == pytest.approx(0.931695, abs=1e-6)
    expected_sums = {
        "loss": loss_sum,
        "accuracy": 1.0 + 0.5 + 1.0,  # the tie 0 = 0 counts ½; margins do not enter accuracy
        "margin": 0.5 + 0.0 + 3.0,  # Σ r_c - r_r (the model's gap, not the required one)
        "chosen_reward": 3.0,
        "rejected_reward": -0.5,
        "reward_sq": 6.25,
        "num_pairs": 3.0,
    }
    expected = {
        "loss": loss_sum / 3,  # 0.612741: mean BT 0.504407 + 0.1 · mean centering 1.083333
        "accuracy": 2.5 / 3,
        "margin": 3.5 / 3,
        "chosen_reward": 1.0,
        "rejected_reward": -0.5 / 3,
        "reward_std": std,
        "num_pairs": 3.0,
    }
    assert set(sums) == set(expected_sums)
    assert set(metrics) == set(expected)
    for name, value in expected_sums.items():
        assert float(sums[name]) == pytest.approx(value, rel=F32_RTOL, abs=1e-7), name
    for name, value in expected.items():
        assert float(metrics[name]) == pytest.approx(value, rel=F32_RTOL, abs=1e-7), name
        assert metrics[name].dtype == jnp.float32, name


def test_objective_without_centering_or_margin_is_the_mean_bradley_terry_loss():
    _, plain = objective(CHOSEN, REJECTED, None, PAIR_MASK, center=None)
    # d = 0.5, 0, 3 without margins.
    expected = (softplus(0.5) + math.log(2.0) + softplus(3.0)) / 3  # 0.405270
    assert float(plain["loss"]) == pytest.approx(expected, rel=F32_RTOL)
    assert expected == pytest.approx(0.4052703, abs=1e-6)
    _, zero = objective(CHOSEN, REJECTED, None, PAIR_MASK, center=0.0)
    assert float(zero["loss"]) == float(plain["loss"])


def test_objective_equals_masked_means_of_the_per_pair_losses():
    chosen, rejected = jnp.array(CHOSEN), jnp.array(REJECTED)
    margin, mask = jnp.array(MARGIN), jnp.array(PAIR_MASK)
    _, metrics = objective(CHOSEN, REJECTED, MARGIN, PAIR_MASK, center=0.1)
    by_mean = losses.masked_mean(
        losses.bradley_terry_loss(chosen, rejected, margin), mask
    ) + 0.1 * losses.masked_mean(losses.centering_penalty(chosen, rejected), mask)
    assert float(metrics["loss"]) == pytest.approx(float(by_mean), rel=F32_RTOL)


def step_loss(chosen, rejected, margin, mask, center, total_pairs):
    """One microbatch's share of the loss, as `rewardax.steps.make_train_step` forms it."""
    sums = losses.reward_metric_sums(chosen, rejected, margin, mask, center)
    return sums["loss"] / total_pairs


def test_objective_gradient_golden_values_margin_and_centering():
    chosen = jnp.array(CHOSEN).at[3].set(1.0)  # padding made finite: its gradient must be 0
    rejected = jnp.array(REJECTED).at[3].set(1.0)
    margin, mask = jnp.array(MARGIN), jnp.array(PAIR_MASK)
    grads = jax.grad(step_loss, argnums=(0, 1))(chosen, rejected, margin, mask, 0.1, 3.0)
    # d/dr_c [-log σ(d) + c (r_c + r_r)²] / n = (σ(d) - 1 + 2c (r_c + r_r)) / n,
    # d/dr_r = (1 - σ(d) + 2c (r_c + r_r)) / n, with d = 0, 0, 2 and r_c + r_r = 1.5, 0, 1.
    d, total = [0.0, 0.0, 2.0], [1.5, 0.0, 1.0]
    want_c = [(sigmoid(x) - 1 + 0.2 * t) / 3 for x, t in zip(d, total, strict=True)] + [0.0]
    want_r = [(1 - sigmoid(x) + 0.2 * t) / 3 for x, t in zip(d, total, strict=True)] + [0.0]
    # First pair: (0.5 - 1 + 0.3) / 3 = -0.066667 for r_c, (1 - 0.5 + 0.3) / 3 = 0.266667 for r_r.
    assert want_c[0] == pytest.approx(-0.2 / 3) and want_r[0] == pytest.approx(0.8 / 3)
    np.testing.assert_allclose(grads[0], want_c, rtol=F32_RTOL, atol=1e-7)
    np.testing.assert_allclose(grads[1], want_r, rtol=F32_RTOL, atol=1e-7)
    # The margin changes the gradient (d = 0.5, 0, 3 without it); padding never contributes.
    no_margin = jax.grad(step_loss)(chosen, rejected, None, mask, 0.1, 3.0)
    assert abs(float(no_margin[0] - grads[0][0])) > 0.02
    assert float(no_margin[1]) == pytest.approx(float(grads[0][1]))  # margin 0 on pair 2
    assert float(no_margin[3]) == 0.0


def test_padding_pairs_change_neither_objective_nor_metrics():
    _, padded = objective(CHOSEN, REJECTED, MARGIN, PAIR_MASK, center=0.05)
    _, real = objective(CHOSEN[:3], REJECTED[:3], MARGIN[:3], PAIR_MASK[:3], center=0.05)
    for name in real:
        assert float(padded[name]) == float(real[name]), name


def test_no_real_pair_gives_zeros_not_nan():
    _, metrics = objective(CHOSEN, REJECTED, MARGIN, [0.0, 0.0, 0.0, 0.0], center=0.1)
    for name, value in metrics.items():
        assert float(value) == 0.0, name


@pytest.mark.parametrize("center", [None, 0.01])
def test_accumulated_microbatches_equal_one_large_batch(center):
    rng = np.random.default_rng(0)
    chosen, rejected, margin = (jnp.asarray(rng.normal(size=8), jnp.float32) for _ in range(3))
    mask = jnp.array([1, 1, 0, 1, 1, 1, 0, 1], jnp.float32)  # uneven real pairs per microbatch
    total_pairs = 6.0
    _, whole = objective(chosen, rejected, margin, mask, center)
    whole_grads = jax.grad(step_loss, argnums=(0, 1))(
        chosen, rejected, margin, mask, center, total_pairs
    )
    # Strided microbatches, as steps._microbatches splits them: pairs 0, 2, 4, 6 and 1, 3, 5, 7.
    parts, grads_c, grads_r = [], np.zeros(8), np.zeros(8)
    for start in (0, 1):
        s = slice(start, 8, 2)
        parts.append(losses.reward_metric_sums(chosen[s], rejected[s], margin[s], mask[s], center))
        g = jax.grad(step_loss, argnums=(0, 1))(
            chosen[s], rejected[s], margin[s], mask[s], center, total_pairs
        )
        grads_c[s], grads_r[s] = g
    finished = losses.metrics_from_sums(jax.tree.map(lambda a, b: a + b, *parts))
    assert set(finished) == set(whole)
    for name, value in whole.items():
        np.testing.assert_allclose(finished[name], value, rtol=F32_RTOL, atol=1e-7, err_msg=name)
    # Each pair's gradient is its own term over the batch's real pairs: equal to the last bit.
    np.testing.assert_array_equal(grads_c, whole_grads[0])
    np.testing.assert_array_equal(grads_r, whole_grads[1])
    assert float(finished["num_pairs"]) == total_pairs


def test_combine_objectives_golden_value_and_gradient():
    objectives = {"helpful": jnp.array(0.5), "safe": jnp.array(2.0, jnp.bfloat16)}
    total = losses.combine_objectives(objectives, {"safe": 0.25, "helpful": 1.0})
    assert total.dtype == jnp.float32
    assert float(total) == pytest.approx(1.0 * 0.5 + 0.25 * 2.0)
    # With real per-objective losses: a pairwise head and a pointwise head, each reduced first.
    chosen, rejected = jnp.array([1.0, 0.0]), jnp.array([0.5, 0.0])
    mask = jnp.array([1.0, 1.0])

    def total_of(c):
        return losses.combine_objectives(
            {
                "pairwise": losses.masked_mean(losses.bradley_terry_loss(c, rejected), mask),
                "centering": losses.masked_mean(losses.centering_penalty(c, rejected), mask),
            },
            {"pairwise": 2.0, "centering": 0.0},
        )

    # 2 · mean(-log σ(0.5), log 2) = softplus(0.5) + log 2 = 1.167224; a zero weight adds nothing.
    assert float(total_of(chosen)) == pytest.approx(softplus(0.5) + math.log(2.0), rel=F32_RTOL)
    # d/dr_c = 2 · (σ(d) - 1) / 2 = σ(d) - 1 per pair.
    np.testing.assert_allclose(jax.grad(total_of)(chosen), [sigmoid(0.5) - 1, -0.5], rtol=F32_RTOL)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": 1.0}, r"no weight for \['b'\]"),
        ({"a": 1.0, "b": 1.0, "c": 1.0}, r"weight without an objective for \['c'\]"),
        ({"a": 1.0, "b": -0.5}, "finite and ≥ 0"),
        ({"a": 1.0, "b": math.nan}, "finite and ≥ 0"),
    ],
)
def test_combine_objectives_rejects_mismatched_or_bad_weights(weights, message):
    objectives = {"a": jnp.array(1.0), "b": jnp.array(2.0)}
    with pytest.raises(ConfigError, match=message):
        losses.combine_objectives(objectives, weights)


def test_combine_objectives_needs_reduced_losses():
    with pytest.raises(DataError, match="reduce it to a scalar"):
        losses.combine_objectives({"a": jnp.zeros(3)}, {"a": 1.0})
    with pytest.raises(ConfigError, match="at least one"):
        losses.combine_objectives({}, {})
