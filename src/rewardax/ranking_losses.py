"""Losses beyond one chosen/rejected pair: K ranked responses, ties, and pointwise scores.

Pure functions of rewards, like `rewardax.losses`. Each returns one float32 value per row ([B]);
reduce it with `rewardax.losses.masked_mean` over the real rows (or sum the values of the real rows
per microbatch and divide once by the number of real rows, which makes gradient accumulation and
multi-device reduction exact, as for Bradley–Terry). Several of them combine with
`rewardax.losses.combine_objectives`.

The train step uses five of them through `train.loss` (`rewardax.losses.group_metric_sums` over
`[B, K]` group batches): `plackett_luce_loss`, `all_pairs_bradley_terry_loss` and
`all_pairs_davidson_loss` (Davidson's tie model over a row's pairs, equal ranks as ties, θ fixed
by train.log_tie_strength) for rows ranking K responses, `mse_loss` and `gaussian_nll_loss`
(log σ² from the second head output) for score rows. `rao_kupper_loss` is not used by the step.

Shapes: B rows; K responses per row for the listwise losses, padded K entries flagged by a
`[B, K]` mask. Ranks are numbers with lower = better (0 = best); equal ranks are a tie.
Padded entries may hold anything, even NaN: they are replaced by 0 before any arithmetic, so that
neither their value nor their gradient reaches a real entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rewardax.errors import DataError

Array = jax.Array


def _float_array(x: Array, name: str, ndim: int, like: tuple[int, ...] | None = None) -> Array:
    """`x` as float32 with `ndim` axes (and shape `like`), or DataError naming the shape."""
    x = jnp.asarray(x)
    if x.ndim != ndim or (like is not None and x.shape != like):
        expected = f"{like}" if like is not None else ("[B]" if ndim == 1 else "[B, K]")
        raise DataError(
            f"{name} has shape {x.shape} but must be {expected}; shapes are not broadcast "
            "(a [B, 1] value against [B] would silently give a [B, B] loss)"
        )
    # float32: rewards may come out of a bfloat16 model (8 mantissa bits); differences of close
    # rewards and log-sum-exps of them would lose most of their precision in bfloat16.
    return x.astype(jnp.float32)


def _listwise(rewards: Array, ranks: Array, mask: Array) -> tuple[Array, Array, Array]:
    """(rewards, ranks, valid) as float32 [B, K], [B, K] and bool [B, K]; padded entries zeroed."""
    rewards = _float_array(rewards, "rewards", 2)
    ranks = _float_array(ranks, "ranks", 2, rewards.shape)
    valid = _float_array(mask, "mask", 2, rewards.shape) > 0
    # where, not multiply: a NaN reward in a padded entry would survive 0 * NaN (and its gradient).
    return jnp.where(valid, rewards, 0.0), jnp.where(valid, ranks, 0.0), valid


def plackett_luce_loss(rewards: Array, ranks: Array, mask: Array) -> Array:
    """Per-row Plackett–Luce negative log-likelihood of the given ranking (ListMLE).

    With the valid responses ordered best first, π(1), …, π(n), Plackett–Luce picks the best of the
    remaining ones with probability softmax over the rewards of those still in play (Plackett 1975,
    "The analysis of permutations", Appl. Statist. 24:193-202; Luce 1959; as a ranking loss:
    Xia et al. 2008, "Listwise approach to learning to rank", ICML, ListMLE):

        loss = Σ_{k=1..n} [ log Σ_{j ≥ k} exp(r_π(j)) − r_π(k) ].

    It is computed without sorting: the term of response i runs over its risk set
    {j valid : rank_j ≥ rank_i}. Tied ranks therefore share their risk sets, which is Breslow's
    approximation for ties (Breslow 1974, Biometrics 30:89-99); without ties it is exact. The last
    response's term is log exp(r) − r = 0. For K = 2 without ties this is the Bradley–Terry loss
    −log σ(r_best − r_other).

    Args:
      rewards: [B, K] rewards.
      ranks: [B, K] ranks, lower = better (0 = best); padded entries may hold anything.
      mask: [B, K] 1 for real responses, 0 for padding. A row with fewer than two real responses
        has loss 0 (exclude it with the row mask when reducing).

    Returns:
      [B] float32. Example: rewards [[2, 1, 0]], ranks [[0, 1, 2]] ->
      [log(e²+e+1) − 2 + log(e+1) − 1] = [0.7209].
    """
    rewards, ranks, valid = _listwise(rewards, ranks, mask)
    # risk[b, i, j]: response j is still in play when response i is picked. A padded i may have
    # an empty risk set: logsumexp gives -inf there with a zero gradient, and `where` drops it.
    risk = valid[:, None, :] & (ranks[:, None, :] >= ranks[:, :, None])
    log_norm = jax.nn.logsumexp(jnp.where(risk, rewards[:, None, :], -jnp.inf), axis=-1)
    return jnp.sum(jnp.where(valid, log_norm - rewards, 0.0), axis=-1)


def all_pairs_bradley_terry_loss(
    rewards: Array, ranks: Array, mask: Array, margin: Array | None = None
) -> Array:
    """Per-row mean Bradley–Terry loss over every ordered pair of a ranking.

    For each pair of real responses with rank_i < rank_j (i strictly better; ties give no pair):
    −log σ(r_i − r_j − m_ij) (Bradley & Terry 1952, Biometrika 39:324-345; all K(K−1)/2 pairs
    of a K-way ranking as in Ouyang et al. 2022, "Training language models to follow
    instructions with human feedback", arXiv:2203.02155, eq. 1), averaged over the row's pairs.
    Each row weighs the same, as a pair does in the pairwise loss, so a row of K = 2 gives exactly
    `rewardax.losses.bradley_terry_loss`.

    Args:
      rewards: [B, K] rewards.
      ranks: [B, K] ranks, lower = better; equal ranks form no pair.
      mask: [B, K] 1 for real responses, 0 for padding.
      margin: [B, K, K] required gap m_ij for "i better than j" (only entries of real pairs are
        read), or None for 0.

    Returns:
      [B] float32; 0 for a row without any pair. Example: rewards [[2, 1, 0]], ranks [[0, 1, 2]]
      -> [(−log σ(1) − log σ(2) − log σ(1)) / 3] = [0.2512].
    """
    rewards, ranks, valid = _listwise(rewards, ranks, mask)
    b, k = rewards.shape
    diff = rewards[:, :, None] - rewards[:, None, :]  # [B, K, K]: r_i − r_j
    if margin is not None:
        diff = diff - _float_array(margin, "margin", 3, (b, k, k))
    pair = valid[:, :, None] & valid[:, None, :] & (ranks[:, :, None] < ranks[:, None, :])
    # where, not multiply: the margin of a non-pair entry may be NaN padding.
    per_pair = jnp.where(pair, -jax.nn.log_sigmoid(jnp.where(pair, diff, 0.0)), 0.0)
    count = jnp.sum(pair, axis=(1, 2)).astype(jnp.float32)
    return jnp.sum(per_pair, axis=(1, 2)) / jnp.maximum(count, 1.0)


def all_pairs_davidson_loss(
    rewards: Array, ranks: Array, mask: Array, log_tie_strength: Array | float
) -> Array:
    """Per-row mean of `davidson_loss` over every pair of a ranking, equal ranks being ties.

    Each unordered pair of real responses {i, j} counts once: rank_i < rank_j is "i preferred"
    (d = r_i − r_j), equal ranks are a tie (either order: the tie term is symmetric in d).
    Averaged over the row's pairs, so each row weighs the same (as `all_pairs_bradley_terry_loss`,
    which this becomes, pair by pair, as θ → −∞ on rows without ties).

    Args:
      rewards: [B, K] rewards; ranks: [B, K], lower = better, equal = tie; mask: [B, K] 1 for
        real responses.
      log_tie_strength: θ = log ν, a scalar (`davidson_loss`).

    Returns:
      [B] float32; 0 for a row of one response. Example: rewards [[1, 0, 0]], ranks [[0, 1, 1]],
      θ = 0: two preferred pairs with d = 1 and one tie with d = 0 ->
      [(2 (logsumexp(½, −½, 0) − ½) + log 3) / 3] = [0.8197].
    """
    rewards, ranks, valid = _listwise(rewards, ranks, mask)
    b, k = rewards.shape
    both = valid[:, :, None] & valid[:, None, :]
    preferred = both & (ranks[:, :, None] < ranks[:, None, :])
    upper = jnp.arange(k)[:, None] < jnp.arange(k)[None, :]  # a tie counted once, as (i < j)
    tie = both & (ranks[:, :, None] == ranks[:, None, :]) & upper
    counted = preferred | tie
    first = jnp.broadcast_to(rewards[:, :, None], (b, k, k)).reshape(-1)
    second = jnp.broadcast_to(rewards[:, None, :], (b, k, k)).reshape(-1)
    per_pair = davidson_loss(
        jnp.where(counted.reshape(-1), first, 0.0),  # padded rewards may be NaN
        jnp.where(counted.reshape(-1), second, 0.0),
        tie.reshape(-1).astype(jnp.float32),
        log_tie_strength,
    ).reshape(b, k, k)
    count = jnp.sum(counted, axis=(1, 2)).astype(jnp.float32)
    return jnp.sum(jnp.where(counted, per_pair, 0.0), axis=(1, 2)) / jnp.maximum(count, 1.0)


def _tie_pairs(
    chosen_rewards: Array, rejected_rewards: Array, tie: Array, margin: Array | None
) -> tuple[Array, Array]:
    """(d, is_tie): d = r_chosen − r_rejected − margin (margin on non-tied pairs only), [B]."""
    chosen = _float_array(chosen_rewards, "chosen_rewards", 1)
    rejected = _float_array(rejected_rewards, "rejected_rewards", 1, chosen.shape)
    is_tie = _float_array(tie, "tie", 1, chosen.shape) > 0
    diff = chosen - rejected
    if margin is not None:
        # A tie has no required gap: the margin only shifts the comparison of a preferred pair.
        margin = _float_array(margin, "margin", 1, chosen.shape)
        diff = diff - jnp.where(is_tie, 0.0, margin)
    return diff, is_tie


def _tie_parameter(value: Array | float, name: str) -> Array:
    value = jnp.asarray(value, jnp.float32)
    if value.ndim != 0:
        raise DataError(f"{name} has shape {value.shape} but must be a scalar")
    return value


def davidson_loss(
    chosen_rewards: Array,
    rejected_rewards: Array,
    tie: Array,
    log_tie_strength: Array | float,
    margin: Array | None = None,
) -> Array:
    """Per-pair negative log-likelihood of Davidson's tie model.

    With strengths π = exp(r) and tie parameter ν = exp(θ) ≥ 0 (Davidson 1970, "On extending the
    Bradley-Terry model to accommodate ties in paired comparison experiments", JASA 65:317-328):

        P(chosen ≻ rejected) = π_c / (π_c + π_r + ν √(π_c π_r)),
        P(tie)               = ν √(π_c π_r) / (π_c + π_r + ν √(π_c π_r)).

    Dividing by √(π_c π_r), with d = r_c − r_r (− margin on preferred pairs) and
    log Z = logsumexp(d/2, −d/2, θ):

        loss = log Z − d/2 for a preferred pair,    loss = log Z − θ for a tie.

    Without ties, as θ → −∞ (ν = 0) this is Bradley–Terry: log(e^{d/2} + e^{−d/2}) − d/2 =
    −log σ(d). A tie is likeliest at d = 0, where P(tie) = ν / (2 + ν). For a tied pair the order
    of chosen and rejected does not matter.

    The tie parameter is an argument, fixed or learned as the caller chooses: the loss is smooth
    in θ, so passing a trainable scalar and differentiating learns it (ν > 0 for any real θ);
    passing a constant fixes it. rewardax fixes it (train.log_tie_strength with train.loss=davidson).

    Args:
      chosen_rewards, rejected_rewards: [B] rewards (for a tie, the two responses in any order).
      tie: [B] 1 where the pair is marked a tie, 0 where chosen is preferred.
      log_tie_strength: θ = log ν, a scalar; −inf gives ν = 0 (Bradley–Terry, ties impossible).
      margin: [B] required gap on preferred pairs, or None.

    Returns:
      [B] float32. Example: d = 0, θ = 0 (ν = 1): tie -> log 3, preferred -> log 3.
    """
    diff, is_tie = _tie_pairs(chosen_rewards, rejected_rewards, tie, margin)
    theta = _tie_parameter(log_tie_strength, "log_tie_strength")
    half = diff / 2.0
    terms = jnp.stack([half, -half, jnp.broadcast_to(theta, half.shape)], axis=-1)
    log_z = jax.nn.logsumexp(terms, axis=-1)
    # The tied branch reads θ only where it is selected: with θ = −inf and no ties, the unselected
    # log Z − θ = +inf never mixes into a value or a gradient.
    return log_z - jnp.where(is_tie, theta, half)


def rao_kupper_loss(
    chosen_rewards: Array,
    rejected_rewards: Array,
    tie: Array,
    log_threshold: Array | float,
    margin: Array | None = None,
) -> Array:
    """Per-pair negative log-likelihood of the Rao–Kupper tie model.

    With π = exp(r) and threshold θ_RK = exp(η) ≥ 1 (Rao & Kupper 1967, "Ties in paired-comparison
    experiments: a generalization of the Bradley-Terry model", JASA 62:194-204):

        P(chosen ≻ rejected) = π_c / (π_c + θ_RK π_r) = σ(d − η),
        P(tie) = (θ_RK² − 1) π_c π_r / ((π_c + θ_RK π_r)(π_r + θ_RK π_c))
               = (e^{2η} − 1) σ(d − η) σ(−d − η),

    with d = r_c − r_r (− margin on preferred pairs). A preferred pair is thus Bradley–Terry with
    an extra margin η; with η = 0 (θ_RK = 1) it is exactly Bradley–Terry and a tie has
    probability 0 (loss +inf; also for η < 0, where the model is not defined). Like `davidson_loss`, η is an argument: fixed, or learned by the
    caller (keep it ≥ 0, e.g. η = softplus(raw)).

    Args:
      chosen_rewards, rejected_rewards: [B] rewards (for a tie, in any order).
      tie: [B] 1 where the pair is marked a tie, 0 where chosen is preferred.
      log_threshold: η = log θ_RK ≥ 0, a scalar.
      margin: [B] required gap on preferred pairs, or None.

    Returns:
      [B] float32. Example: d = 0, η = log 2: preferred -> −log(1/3) = log 3,
      tie -> −log(3 · 1/3 · 1/3) = log 3.
    """
    diff, is_tie = _tie_pairs(chosen_rewards, rejected_rewards, tie, margin)
    eta = _tie_parameter(log_threshold, "log_threshold")
    win = -jax.nn.log_sigmoid(diff - eta)
    # log(e^{2η} − 1) = 2η + log(1 − e^{−2η}): no overflow for large η, and expm1 keeps small η.
    # At η ≤ 0 ties are impossible (factor 0, log −inf); the formula is fed a safe η there so that
    # its infinite derivative never meets the zero cotangent of an unselected branch (0 · inf = NaN).
    positive = eta > 0
    safe_eta = jnp.where(positive, eta, 1.0)
    log_tie_factor = jnp.where(
        positive, 2.0 * safe_eta + jnp.log(-jnp.expm1(-2.0 * safe_eta)), -jnp.inf
    )
    tied = win - jax.nn.log_sigmoid(-diff - eta) - log_tie_factor
    return jnp.where(is_tie, tied, win)


def mse_loss(predicted: Array, target: Array) -> Array:
    """Per-row squared error (r − y)² of a pointwise reward against a score.

    Args:
      predicted: [B] rewards; target: [B] scores (e.g. a human rating).

    Returns:
      [B] float32. Example: predicted [1.0, 2.0], target [0.5, 2.0] -> [0.25, 0.0].
    """
    predicted = _float_array(predicted, "predicted", 1)
    target = _float_array(target, "target", 1, predicted.shape)
    return jnp.square(predicted - target)


def gaussian_nll_loss(predicted: Array, target: Array, log_variance: Array | float) -> Array:
    """Per-row Gaussian negative log-likelihood of a score y under N(r, σ²).

        loss = ½ (log 2π + log σ² + (y − r)² / σ²)

    (Nix & Weigend 1994, "Estimating the mean and variance of the target probability
    distribution", ICNN; Lakshminarayanan et al. 2017, "Simple and scalable predictive
    uncertainty estimation using deep ensembles", arXiv:1612.01474). The variance is taken as
    log σ² so that any real number is valid: pass a [B] array for a predicted variance (e.g. a
    second head's output) or a scalar for a fixed one. With σ² = 1 the loss is ½ MSE + ½ log 2π;
    for a fixed error it is smallest at σ² = (y − r)².

    Args:
      predicted: [B] predicted means r; target: [B] scores y.
      log_variance: [B] predicted log σ², or a scalar fixed log σ².

    Returns:
      [B] float32. Example: r 1, y 3, log σ² = log 4 -> ½(log 2π + log 4 + 1) = 2.1121.
    """
    predicted = _float_array(predicted, "predicted", 1)
    target = _float_array(target, "target", 1, predicted.shape)
    log_variance = jnp.asarray(log_variance)
    if log_variance.ndim != 0:
        log_variance = _float_array(log_variance, "log_variance", 1, predicted.shape)
    log_variance = log_variance.astype(jnp.float32)
    error = jnp.square(target - predicted)
    return 0.5 * (jnp.log(2.0 * jnp.pi) + log_variance + error * jnp.exp(-log_variance))
