"""Golden values, closed forms and gradients of rewardax.ranking_losses.

The references below are written out in float64 numpy, independently of the module (sorting and
sequential softmax for Plackett-Luce, explicit pair loops for all-pairs Bradley-Terry), so that a
reader can check every expected number by hand.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rewardax import losses
from rewardax import ranking_losses as rl
from rewardax.errors import DataError
from tolerances import F32_ATOL, F32_RTOL, NUMERIC_GRAD_ATOL


def softplus(x: float) -> float:
    """-log σ(x) = log(1 + e^-x)."""
    return math.log1p(math.exp(-x))


def plackett_luce_reference(rewards, ranks, mask) -> np.ndarray:
    """Σ_k [log Σ_{j ≥ k} exp(r_π(j)) - r_π(k)], π = the real responses sorted best first."""
    out = []
    for r, rank, m in zip(rewards, ranks, mask, strict=True):
        order = [i for i in np.argsort(rank, kind="stable") if m[i]]
        ordered = np.asarray(r, np.float64)[order]
        out.append(
            sum(np.log(np.sum(np.exp(ordered[k:]))) - ordered[k] for k in range(len(ordered)))
        )
    return np.asarray(out)


def all_pairs_reference(rewards, ranks, mask, margin=None) -> np.ndarray:
    """Mean over pairs (i, j) of real responses with rank_i < rank_j of -log σ(r_i - r_j - m_ij)."""
    out = []
    for b, (r, rank, m) in enumerate(zip(rewards, ranks, mask, strict=True)):
        terms = [
            softplus(r[i] - r[j] - (0.0 if margin is None else margin[b][i][j]))
            for i in range(len(r))
            for j in range(len(r))
            if m[i] and m[j] and rank[i] < rank[j]
        ]
        out.append(sum(terms) / len(terms) if terms else 0.0)
    return np.asarray(out)


def numeric_gradient(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of a float64 function."""
    grad = np.zeros_like(x, np.float64)
    for index in np.ndindex(x.shape):
        up, down = x.astype(np.float64), x.astype(np.float64)
        up[index] += h
        down[index] -= h
        grad[index] = (f(up) - f(down)) / (2 * h)
    return grad


# --- Plackett-Luce -------------------------------------------------------------------------------


def test_plackett_luce_golden_value_three_responses():
    got = rl.plackett_luce_loss(
        jnp.array([[2.0, 1.0, 0.0]]), jnp.array([[0, 1, 2]]), jnp.ones((1, 3))
    )
    # Pick 2 among {2, 1, 0}: log(e² + e + 1) - 2 = 2.407606 - 2 = 0.407606;
    # pick 1 among {1, 0}: log(e + 1) - 1 = 0.313262; the last pick has probability 1.
    expected = math.log(math.e**2 + math.e + 1) - 2 + math.log(math.e + 1) - 1
    assert expected == pytest.approx(0.720868, abs=1e-6)
    assert got.shape == (1,) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, [expected], rtol=F32_RTOL)


def test_plackett_luce_permuted_ranks_and_padding_match_the_reference():
    rewards = np.array([[0.3, -1.2, 2.0, np.nan], [1.0, 0.5, -0.5, 0.25]], np.float32)
    ranks = np.array([[2, 0, 1, 99], [3, 1, 0, 2]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
    got = rl.plackett_luce_loss(rewards, ranks, mask)
    # Row 0: order -1.2, 2.0, 0.3 -> log(e^-1.2 + e^2 + e^0.3) + 1.2 + log(e^2 + e^0.3) - 2.
    row0 = math.log(math.exp(-1.2) + math.exp(2.0) + math.exp(0.3)) + 1.2
    row0 += math.log(math.exp(2.0) + math.exp(0.3)) - 2.0
    np.testing.assert_allclose(got[0], row0, rtol=F32_RTOL)
    np.testing.assert_allclose(got, plackett_luce_reference(rewards, ranks, mask), rtol=F32_RTOL)


def test_plackett_luce_with_two_responses_is_bradley_terry():
    rng = np.random.default_rng(0)
    best, other = rng.normal(size=6).astype(np.float32), rng.normal(size=6).astype(np.float32)
    ranks = np.tile([0, 1], (6, 1))
    got = rl.plackett_luce_loss(np.stack([best, other], 1), ranks, np.ones((6, 2)))
    # log(e^a + e^b) - a = log(1 + e^(b - a)) = -log σ(a - b).
    np.testing.assert_allclose(got, losses.bradley_terry_loss(best, other), rtol=F32_RTOL)
    # The same with the best response second.
    swapped = rl.plackett_luce_loss(np.stack([other, best], 1), ranks[:, ::-1], np.ones((6, 2)))
    np.testing.assert_allclose(swapped, got, rtol=F32_RTOL)


def test_plackett_luce_ties_share_their_risk_set():
    got = rl.plackett_luce_loss(
        jnp.array([[1.0, 0.0, -1.0]]), jnp.array([[0, 0, 1]]), jnp.ones((1, 3))
    )
    # Breslow: both tied responses are picked from {1, 0, -1}, then -1 from itself.
    z = math.log(math.e + 1 + math.exp(-1.0))  # 1.407606
    np.testing.assert_allclose(got, [2 * z - 1.0 - 0.0], rtol=F32_RTOL)


def test_plackett_luce_rows_with_fewer_than_two_responses_are_zero():
    rewards = jnp.array([[5.0, 1.0], [jnp.nan, jnp.nan], [0.5, 2.0]])
    ranks = jnp.array([[0, 1], [0, 1], [-3, -2]])  # any numbers order a row, negative ones too
    mask = jnp.array([[1, 0], [0, 0], [1, 1]])

    def loss(r):
        return rl.plackett_luce_loss(r, ranks, mask)

    # Row 2: 0.5 (rank -3) is best: log(e^0.5 + e^2) - 0.5 = -log σ(0.5 - 2) = 1.701413.
    np.testing.assert_allclose(loss(rewards), [0.0, 0.0, softplus(-1.5)], rtol=F32_RTOL)
    # A fully padded row (empty risk sets, NaN rewards) gives zero gradient, not NaN.
    grads = jax.grad(lambda r: jnp.sum(loss(r)))(rewards)
    np.testing.assert_array_equal(grads[:2], np.zeros((2, 2)))
    assert bool(jnp.all(jnp.isfinite(grads)))


def test_plackett_luce_gradient_matches_numeric_differences_and_skips_padding():
    rewards = np.array([[0.3, -1.2, 2.0, 7.0], [1.0, 0.5, -0.5, 0.25]])
    ranks = np.array([[2, 0, 1, 0], [3, 1, 0, 2]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]])

    got = jax.grad(lambda r: jnp.sum(rl.plackett_luce_loss(r, ranks, mask)))(
        jnp.asarray(rewards, jnp.float32)
    )
    numeric = numeric_gradient(lambda r: plackett_luce_reference(r, ranks, mask).sum(), rewards)
    np.testing.assert_allclose(got, numeric, atol=NUMERIC_GRAD_ATOL)
    assert float(got[0, 3]) == 0.0  # the padded response gets no gradient


def test_plackett_luce_padding_never_changes_the_real_responses():
    mask = jnp.array([[1, 1, 1, 0]], jnp.float32)
    ranks = jnp.array([[1, 0, 2, 0]])

    def loss(pad):
        rewards = jnp.array([0.3, -1.2, 2.0])
        return jnp.sum(rl.plackett_luce_loss(jnp.append(rewards, pad)[None], ranks, mask))

    assert float(loss(jnp.nan)) == float(loss(1e9)) == float(loss(0.0))
    assert not bool(jnp.isnan(jax.grad(loss)(jnp.nan)))


# --- All-pairs Bradley-Terry ---------------------------------------------------------------------


def test_all_pairs_golden_value_three_responses():
    got = rl.all_pairs_bradley_terry_loss(
        jnp.array([[2.0, 1.0, 0.0]]), jnp.array([[0, 1, 2]]), jnp.ones((1, 3))
    )
    # Pairs (2 vs 1), (2 vs 0), (1 vs 0): differences 1, 2, 1.
    expected = (softplus(1.0) + softplus(2.0) + softplus(1.0)) / 3  # (0.313262·2 + 0.126928) / 3
    assert expected == pytest.approx(0.251150, abs=1e-6)
    np.testing.assert_allclose(got, [expected], rtol=F32_RTOL)


def test_all_pairs_ties_padding_and_margin_match_the_reference():
    rewards = np.array([[1.0, 0.0, -1.0, np.nan], [0.5, 1.5, -0.5, 0.0]], np.float32)
    ranks = np.array([[0, 0, 1, 0], [1, 0, 2, 2]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
    margin = np.zeros((2, 4, 4), np.float32)
    margin[1, 1, 0] = 1.0  # response 1 must beat response 0 by 1
    margin[0, 0, 3] = np.nan  # a padded pair: never read
    got = rl.all_pairs_bradley_terry_loss(rewards, ranks, mask, margin)
    # Row 0: the tie (0, 1) is no pair; pairs (0 vs 2) d = 2, (1 vs 2) d = 1.
    row0 = (softplus(2.0) + softplus(1.0)) / 2
    # Row 1: 1 beats 0 (d = 1.5 - 0.5 - 1 = 0), 1 beats 2, 1 beats 3, 0 beats 2, 0 beats 3;
    # 2 and 3 are tied. d = 0, 2, 1.5, 1, 0.5.
    row1 = (math.log(2) + softplus(2.0) + softplus(1.5) + softplus(1.0) + softplus(0.5)) / 5
    np.testing.assert_allclose(got, [row0, row1], rtol=F32_RTOL)
    np.testing.assert_allclose(
        got, all_pairs_reference(rewards, ranks, mask, margin), rtol=F32_RTOL
    )


def test_all_pairs_with_two_responses_is_the_pairwise_loss_with_margin():
    rng = np.random.default_rng(1)
    chosen, rejected, gap = (rng.normal(size=5).astype(np.float32) for _ in range(3))
    margin = np.zeros((5, 2, 2), np.float32)
    margin[:, 0, 1] = gap
    got = rl.all_pairs_bradley_terry_loss(
        np.stack([chosen, rejected], 1), np.tile([0, 1], (5, 1)), np.ones((5, 2)), margin
    )
    np.testing.assert_allclose(got, losses.bradley_terry_loss(chosen, rejected, gap), rtol=F32_RTOL)


def test_all_pairs_row_without_pairs_is_zero_and_gradient_matches_numeric():
    ranks = np.array([[0, 0, 0], [2, 0, 1]])
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    rewards = np.array([[0.1, 0.2, 0.3], [0.4, -0.3, 9.0]])
    got = rl.all_pairs_bradley_terry_loss(rewards, ranks, mask)
    assert float(got[0]) == 0.0  # all tied: no pair
    grad = jax.grad(lambda r: jnp.sum(rl.all_pairs_bradley_terry_loss(r, ranks, mask)))(
        jnp.asarray(rewards, jnp.float32)
    )
    numeric = numeric_gradient(lambda r: all_pairs_reference(r, ranks, mask).sum(), rewards)
    np.testing.assert_allclose(grad, numeric, atol=NUMERIC_GRAD_ATOL)
    # Only pair: response 1 (rank 0) beats response 0 (rank 2), d = -0.7: σ(d) - 1 for the winner.
    assert float(grad[1, 1]) == pytest.approx(1 / (1 + math.exp(0.7)) - 1, rel=10 * F32_RTOL)


def test_listwise_losses_accumulate_exactly_over_microbatches():
    rng = np.random.default_rng(2)
    rewards = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    ranks = jnp.asarray(np.argsort(rng.normal(size=(6, 4)), axis=1))
    mask = jnp.asarray(rng.random((6, 4)) < 0.8, jnp.float32)
    rows = jnp.array([1, 1, 0, 1, 1, 1], jnp.float32)  # a padding row
    for loss_fn in (rl.plackett_luce_loss, rl.all_pairs_bradley_terry_loss):
        whole = losses.masked_mean(loss_fn(rewards, ranks, mask), rows)
        # Sum the real rows of each microbatch, divide once by the batch's real rows.
        summed = sum(
            jnp.sum(jnp.where(rows[s] > 0, loss_fn(rewards[s], ranks[s], mask[s]), 0.0))
            for s in (slice(0, 2), slice(2, 6))
        )
        np.testing.assert_allclose(summed / 5.0, whole, rtol=F32_RTOL)


@pytest.mark.parametrize("loss_fn", [rl.plackett_luce_loss, rl.all_pairs_bradley_terry_loss])
def test_listwise_shapes_are_checked_and_bfloat16_upcast(loss_fn):
    with pytest.raises(DataError, match="ranks has shape"):
        loss_fn(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)))
    with pytest.raises(DataError, match="mask has shape"):
        loss_fn(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 1)))
    with pytest.raises(DataError, match="rewards has shape"):
        loss_fn(jnp.zeros(3), jnp.zeros(3), jnp.ones(3))
    got = loss_fn(jnp.array([[1.0, 0.5]], jnp.bfloat16), jnp.array([[0, 1]]), jnp.ones((1, 2)))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, [softplus(0.5)], rtol=F32_RTOL)


# --- Davidson and Rao-Kupper ties ----------------------------------------------------------------


def test_davidson_golden_values():
    # d = log 4 (e^(d/2) = 2), ν = 0.5: Z = 2 + 1/2 + 0.5 = 3.
    # Preferred: -log(2/3) = log 1.5; tie: -log(0.5/3) = log 6. At d = 0, ν = 1: Z = 3 for both.
    chosen = jnp.array([math.log(4.0), math.log(4.0), 0.0, 0.0])
    tie = jnp.array([0, 1, 0, 1])
    got = rl.davidson_loss(chosen, jnp.zeros(4), tie, math.log(0.5))
    np.testing.assert_allclose(got[:2], [math.log(1.5), math.log(6.0)], rtol=F32_RTOL)
    got = rl.davidson_loss(chosen, jnp.zeros(4), tie, 0.0)
    np.testing.assert_allclose(got[2:], [math.log(3.0), math.log(3.0)], rtol=F32_RTOL)


def test_davidson_without_ties_reduces_to_bradley_terry():
    rng = np.random.default_rng(3)
    chosen, rejected, margin = (rng.normal(size=5).astype(np.float32) for _ in range(3))
    no_tie = np.zeros(5)
    # ν = 0 (Davidson 1970, §2): P(i ≻ j) = π_i / (π_i + π_j), Bradley-Terry's.
    got = rl.davidson_loss(chosen, rejected, no_tie, -jnp.inf, margin)
    np.testing.assert_allclose(
        got, losses.bradley_terry_loss(chosen, rejected, margin), rtol=F32_RTOL
    )
    grads = jax.grad(lambda c: jnp.sum(rl.davidson_loss(c, rejected, no_tie, -jnp.inf)))(chosen)
    bt_grads = jax.grad(lambda c: jnp.sum(losses.bradley_terry_loss(c, rejected)))(chosen)
    np.testing.assert_allclose(grads, bt_grads, rtol=F32_RTOL)


@pytest.mark.parametrize("loss_fn", [rl.davidson_loss, rl.rao_kupper_loss])
def test_tie_models_probabilities_sum_to_one_and_ties_are_symmetric(loss_fn):
    chosen, rejected = jnp.array([0.7, -1.0, 0.0]), jnp.array([0.2, 1.5, 0.0])
    parameter = 0.4

    def prob(c, r, tie):
        return np.exp(-np.asarray(loss_fn(c, r, jnp.full(3, tie), parameter)))

    # P(c ≻ r) + P(r ≻ c) + P(tie) = 1 for every pair.
    total = prob(chosen, rejected, 0) + prob(rejected, chosen, 0) + prob(chosen, rejected, 1)
    np.testing.assert_allclose(total, 1.0, rtol=F32_RTOL)
    np.testing.assert_allclose(prob(chosen, rejected, 1), prob(rejected, chosen, 1), rtol=F32_RTOL)


def test_davidson_tie_parameter_gradient_matches_numeric_differences():
    chosen, rejected = np.array([0.7, -1.0, 0.3]), np.array([0.2, 1.5, 0.3])
    tie = np.array([0, 1, 1])

    def reference(theta: float) -> float:  # the paper's probabilities, float64
        pc, pr = np.exp(chosen), np.exp(rejected)
        nu = math.exp(theta)
        z = pc + pr + nu * np.sqrt(pc * pr)
        return float(-np.sum(np.log(np.where(tie > 0, nu * np.sqrt(pc * pr), pc) / z)))

    got = jax.grad(lambda t: jnp.sum(rl.davidson_loss(chosen, rejected, tie, t)))(0.25)
    assert float(jnp.sum(rl.davidson_loss(chosen, rejected, tie, 0.25))) == pytest.approx(
        reference(0.25), rel=F32_RTOL
    )
    numeric = (reference(0.25 + 1e-6) - reference(0.25 - 1e-6)) / 2e-6
    assert float(got) == pytest.approx(numeric, rel=1e-4)


def test_davidson_margin_applies_to_preferred_pairs_only():
    tie = jnp.array([0, 1])
    with_margin = rl.davidson_loss(jnp.ones(2), jnp.zeros(2), tie, 0.0, jnp.array([1.0, 1.0]))
    without = rl.davidson_loss(jnp.zeros(2), jnp.zeros(2), tie, 0.0)
    # Preferred pair: d = 1 - 0 - 1 = 0 -> log 3; tied pair: d = 1, margin ignored.
    assert float(with_margin[0]) == pytest.approx(float(without[0]))
    assert float(with_margin[1]) == pytest.approx(
        math.log(math.exp(0.5) + math.exp(-0.5) + 1.0), rel=F32_RTOL
    )


def test_rao_kupper_golden_values():
    # η = log 2 (θ = 2). d = 0: P(≻) = 1/(1 + 2) -> log 3; P(tie) = 3 · (1/3)(1/3) -> log 3.
    # d = log 2: P(≻) = σ(0) = 1/2 -> log 2; P(tie) = 3 · σ(0) σ(-2 log 2) = 3 · 1/2 · 1/5 = 0.3.
    chosen = jnp.array([0.0, 0.0, math.log(2.0), math.log(2.0)])
    got = rl.rao_kupper_loss(chosen, jnp.zeros(4), jnp.array([0, 1, 0, 1]), math.log(2.0))
    expected = [math.log(3.0), math.log(3.0), math.log(2.0), -math.log(0.3)]
    np.testing.assert_allclose(got, expected, rtol=F32_RTOL)


def test_rao_kupper_preferred_pairs_are_bradley_terry_with_margin_eta():
    rng = np.random.default_rng(4)
    chosen, rejected, margin = (rng.normal(size=5).astype(np.float32) for _ in range(3))
    eta = 0.3
    got = rl.rao_kupper_loss(chosen, rejected, np.zeros(5), eta, margin)
    bt = losses.bradley_terry_loss(chosen, rejected, margin + eta)
    np.testing.assert_allclose(got, bt, rtol=F32_RTOL)
    # η = 0 (θ = 1, Rao & Kupper 1967): plain Bradley-Terry, and a tie is impossible.
    np.testing.assert_allclose(
        rl.rao_kupper_loss(chosen, rejected, np.zeros(5), 0.0),
        losses.bradley_terry_loss(chosen, rejected),
        rtol=F32_RTOL,
    )
    assert float(rl.rao_kupper_loss(jnp.zeros(1), jnp.zeros(1), jnp.ones(1), 0.0)[0]) == jnp.inf
    # With no tie the gradient in η at 0 is finite (the tie branch's log(e^{2η} - 1) = -inf at
    # η = 0 must not leak a NaN): d/dη [-log σ(d - η)] = 1 - σ(d - η), at η = 0: Σ 1 - σ(d).
    grad = jax.grad(lambda e: jnp.sum(rl.rao_kupper_loss(chosen, rejected, np.zeros(5), e)))(0.0)
    d = chosen.astype(np.float64) - rejected
    assert float(grad) == pytest.approx(float(np.sum(1 - 1 / (1 + np.exp(-d)))), rel=10 * F32_RTOL)


def test_rao_kupper_gradient_matches_numeric_differences():
    chosen, rejected = np.array([0.7, -1.0, 0.3]), np.array([0.2, 1.5, 0.1])
    tie = np.array([0, 1, 1])

    def reference(args: np.ndarray) -> float:  # Rao & Kupper's probabilities, float64
        *c, eta = args
        pc, pr, theta = np.exp(np.array(c)), np.exp(rejected), math.exp(eta)
        win = pc / (pc + theta * pr)
        tied = (theta**2 - 1) * pc * pr / ((pc + theta * pr) * (pr + theta * pc))
        return float(-np.sum(np.log(np.where(tie > 0, tied, win))))

    point = np.array([*chosen, 0.5])
    got = jax.grad(lambda a: jnp.sum(rl.rao_kupper_loss(a[:3], rejected, tie, a[3])))(
        jnp.asarray(point, jnp.float32)
    )
    np.testing.assert_allclose(
        got, numeric_gradient(reference, point), rtol=1e-4, atol=NUMERIC_GRAD_ATOL
    )


def test_tie_models_check_shapes():
    with pytest.raises(DataError, match="tie has shape"):
        rl.davidson_loss(jnp.zeros(3), jnp.zeros(3), jnp.zeros((3, 1)), 0.0)
    with pytest.raises(DataError, match="log_threshold has shape"):
        rl.rao_kupper_loss(jnp.zeros(3), jnp.zeros(3), jnp.zeros(3), jnp.zeros(3))


# --- Pointwise regression ------------------------------------------------------------------------


def test_mse_golden_values():
    got = rl.mse_loss(jnp.array([1.0, 2.0, -1.0]), jnp.array([0.5, 2.0, 1.0]))
    np.testing.assert_allclose(got, [0.25, 0.0, 4.0])  # 0.5², 0², 2²
    assert got.dtype == jnp.float32
    with pytest.raises(DataError, match="target has shape"):
        rl.mse_loss(jnp.zeros(3), jnp.zeros((3, 1)))


def test_gaussian_nll_golden_values_fixed_and_predicted_variance():
    half_log_2pi = 0.5 * math.log(2 * math.pi)  # 0.918939
    # Fixed σ² = 4: ½(log 2π + log 4 + (3 - 1)²/4) = 0.918939 + 0.693147 + 0.5 = 2.112086.
    fixed = rl.gaussian_nll_loss(jnp.array([1.0]), jnp.array([3.0]), math.log(4.0))
    np.testing.assert_allclose(fixed, [2.112086], rtol=F32_RTOL)
    # Predicted variances per row: σ² = 1 and σ² = e²: ½(log 2π + 0 + 1) and ½(log 2π + 2 + 4/e²).
    got = rl.gaussian_nll_loss(jnp.array([0.0, 0.0]), jnp.array([1.0, 2.0]), jnp.array([0.0, 2.0]))
    expected = [half_log_2pi + 0.5, half_log_2pi + 1.0 + 2.0 / math.e**2]
    np.testing.assert_allclose(got, expected, rtol=F32_RTOL)


def test_gaussian_nll_closed_forms():
    rng = np.random.default_rng(5)
    predicted, target = rng.normal(size=6).astype(np.float32), rng.normal(size=6).astype(np.float32)
    # σ² = 1: the NLL is ½ MSE + ½ log 2π.
    np.testing.assert_allclose(
        rl.gaussian_nll_loss(predicted, target, 0.0),
        0.5 * rl.mse_loss(predicted, target) + 0.5 * math.log(2 * math.pi),
        rtol=F32_RTOL,
    )
    # For fixed errors the best variance is the squared error: zero gradient in log σ² there.
    log_var = np.log(np.square(predicted - target))
    grad = jax.grad(lambda v: jnp.sum(rl.gaussian_nll_loss(predicted, target, v)))(log_var)
    np.testing.assert_allclose(grad, 0.0, atol=F32_ATOL)
    with pytest.raises(DataError, match="log_variance has shape"):
        rl.gaussian_nll_loss(predicted, target, jnp.zeros((6, 1)))


def test_gaussian_nll_gradient_matches_numeric_differences():
    target = np.array([1.0, -0.5])

    def reference(args: np.ndarray) -> float:  # log N(y; μ, σ²), float64
        mean, log_var = args[:2], args[2:]
        var = np.exp(log_var)
        return float(np.sum(0.5 * np.log(2 * np.pi * var) + (target - mean) ** 2 / (2 * var)))

    point = np.array([0.3, 0.2, -0.4, 0.7])
    got = jax.grad(lambda a: jnp.sum(rl.gaussian_nll_loss(a[:2], target, a[2:])))(
        jnp.asarray(point, jnp.float32)
    )
    np.testing.assert_allclose(
        got, numeric_gradient(reference, point), rtol=1e-5, atol=NUMERIC_GRAD_ATOL / 10
    )


def test_all_pairs_davidson_by_hand_ties_and_limits():
    # The docstring's row: preferred pairs d = 1 (twice) and one tie at d = 0, θ = 0 (ν = 1).
    preferred = math.log(math.exp(0.5) + math.exp(-0.5) + 1.0) - 0.5
    got = rl.all_pairs_davidson_loss(
        jnp.array([[1.0, 0.0, 0.0]]), jnp.array([[0, 1, 1]]), jnp.ones((1, 3)), 0.0
    )
    np.testing.assert_allclose(got, [(2 * preferred + math.log(3.0)) / 3], rtol=1e-6)
    assert float(got[0]) == pytest.approx(0.8197, abs=1e-4)
    # Two responses: the pairwise davidson_loss itself, preferred or tied.
    rewards = jnp.array([[0.3, -1.2], [0.4, 0.9]])
    ranks = jnp.array([[0, 1], [2, 2]])
    pairwise = rl.davidson_loss(rewards[:, 0], rewards[:, 1], jnp.array([0.0, 1.0]), math.log(0.5))
    np.testing.assert_allclose(
        rl.all_pairs_davidson_loss(rewards, ranks, jnp.ones((2, 2)), math.log(0.5)),
        pairwise,
        rtol=1e-6,
    )
    # θ -> -inf on a row without ties: all-pairs Bradley-Terry; a NaN padded reward changes
    # neither the value nor the gradient.
    rewards = jnp.array([[2.0, 1.0, 0.0, jnp.nan]])
    ranks = jnp.array([[0, 2, 1, 0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    np.testing.assert_allclose(
        rl.all_pairs_davidson_loss(rewards, ranks, mask, -40.0),
        rl.all_pairs_bradley_terry_loss(rewards, ranks, mask),
        rtol=1e-6,
    )
    grad = jax.grad(lambda r: rl.all_pairs_davidson_loss(r, ranks, mask, 0.0).sum())
    g = np.asarray(grad(rewards))
    assert np.isfinite(g).all() and g[0, 3] == 0.0
