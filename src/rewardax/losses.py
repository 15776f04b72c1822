"""Reward-model losses and metrics: pure functions of per-pair rewards.

Shapes: B is the number of pairs in a batch (padding pairs included, flagged by `pair_mask`).
Per-pair functions return `[B]` float32 values. The training objective is reduced in one place:
`reward_metric_sums` (sums over the real pairs of a microbatch, additive across microbatches and
devices) and `metrics_from_sums` (divides once by the number of real pairs), so that padding pairs
never count and a sharded or accumulated batch is averaged per example over the whole batch.
`masked_mean` is the same reduction for a single batch of any per-row loss (the listwise, tie and
pointwise losses of `rewardax.ranking_losses`), and `combine_objectives` sums several reduced
objectives with named weights.

Group batches (K responses per row, `rewardax.steps.group_logits`) are reduced the same way by
`group_metric_sums` and `group_metrics_from_sums`: the per-row formulas are
`rewardax.ranking_losses`'s, summed over the real rows (`row_mask`) and divided once by their
number over the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from rewardax import ranking_losses
from rewardax.errors import ConfigError, DataError

Array = jax.Array


def _as_pair_vector(x: Array, name: str, like: tuple[int, ...] | None = None) -> Array:
    """`x` as a float32 [B] array, or DataError when its shape is not [B] (or not `like`)."""
    x = jnp.asarray(x)
    if x.ndim != 1 or (like is not None and x.shape != like):
        expected = f"[B] = {like}" if like is not None else "[B] (one value per pair)"
        raise DataError(
            f"{name} has shape {x.shape} but must be {expected}; a [B, 1] value would broadcast "
            "against [B] rewards into a [B, B] loss, so squeeze the trailing axis"
        )
    # float32: rewards may come out of a bfloat16 model (8 mantissa bits); the difference of two
    # close rewards, log σ of it and its gradient would lose most of their precision in bfloat16.
    return x.astype(jnp.float32)


def _pair(chosen_rewards: Array, rejected_rewards: Array) -> tuple[Array, Array]:
    chosen = _as_pair_vector(chosen_rewards, "chosen_rewards")
    rejected = _as_pair_vector(rejected_rewards, "rejected_rewards", chosen.shape)
    return chosen, rejected


def bradley_terry_loss(
    chosen_rewards: Array, rejected_rewards: Array, margin: Array | None = None
) -> Array:
    """Per-pair Bradley–Terry negative log-likelihood `-log σ(r_chosen − r_rejected − margin)`.

    Args:
      chosen_rewards: [B] rewards of the preferred responses.
      rejected_rewards: [B] rewards of the other responses.
      margin: [B] required reward gap per pair (Llama 2's margin loss), or None for 0.

    Returns:
      [B] float32 losses. Example: chosen [1.0], rejected [0.5] -> [-log σ(0.5)] = [0.474077].
    """
    chosen, rejected = _pair(chosen_rewards, rejected_rewards)
    diff = chosen - rejected
    if margin is not None:
        diff = diff - _as_pair_vector(margin, "margin", chosen.shape)
    # log_sigmoid is stable for large |diff| (no log(0) = -inf once σ underflows).
    return -jax.nn.log_sigmoid(diff)


def centering_penalty(chosen_rewards: Array, rejected_rewards: Array) -> Array:
    """Per-pair `(r_chosen + r_rejected)²`; the trainer multiplies its mean by a coefficient.

    The Bradley–Terry loss only sees reward differences, so their overall level drifts freely; this
    auxiliary term (Eisenstein et al. 2023, "Helping or Herding? Reward Model Ensembles Mitigate but
    do not Eliminate Reward Hacking", arXiv:2312.09244) keeps rewards centred on zero.

    Args:
      chosen_rewards: [B]; rejected_rewards: [B].

    Returns:
      [B] float32 penalties. Example: chosen [1.0], rejected [0.5] -> [2.25].
    """
    chosen, rejected = _pair(chosen_rewards, rejected_rewards)
    return jnp.square(chosen + rejected)


def pairwise_accuracy(chosen_rewards: Array, rejected_rewards: Array) -> Array:
    """Per-pair accuracy: 1 if r_chosen > r_rejected, ½ on a tie, 0 otherwise.

    A tie is a coin flip for a ranking, so it counts half (a model scoring everything 0 reads 0.5,
    not 0 or 1). NaN rewards count 0.

    Returns:
      [B] float32 in {0, 0.5, 1}. Example: chosen [2, 1, 0], rejected [1, 1, 3] -> [1, 0.5, 0].
    """
    chosen, rejected = _pair(chosen_rewards, rejected_rewards)
    return jnp.where(chosen > rejected, 1.0, jnp.where(chosen == rejected, 0.5, 0.0))


def masked_mean(values: Array, mask: Array) -> Array:
    """Mean of `values` over the entries where `mask` is 1 (the real pairs); 0 when none are.

    Under `jax.jit` with a batch sharded over devices, the sums below are global reductions (XLA
    inserts the all-reduce), so the result is a per-example mean over the whole batch.

    Args:
      values: [B] per-pair values; entries where mask is 0 may hold anything, even NaN.
      mask: [B] 1.0 for real pairs, 0.0 for padding pairs (`pair_mask`).

    Returns:
      scalar float32.
    """
    values = _as_pair_vector(values, "values")
    mask = _as_pair_vector(mask, "mask", values.shape)
    # where, not values * mask: a NaN in a padding pair would survive 0 * NaN.
    total = jnp.sum(jnp.where(mask > 0, values * mask, 0.0))
    return total / jnp.maximum(jnp.sum(mask), 1.0)


def reward_metric_sums(
    chosen_rewards: Array,
    rejected_rewards: Array,
    margin: Array | None,
    pair_mask: Array,
    center_coefficient: float | None = None,
) -> dict[str, Array]:
    """Sums over the real pairs of one (micro)batch, additive across microbatches and devices.

    Gradient accumulation adds these over microbatches and calls `metrics_from_sums` once, which
    gives exactly the values of one large batch (a mean of per-microbatch means would weigh a
    microbatch with few real pairs as much as a full one).

    Returns:
      scalars: loss (BT loss + c·centering, summed), accuracy, margin, chosen_reward,
      rejected_reward, reward_sq (Σ r_c² + r_r²), num_pairs.
    """
    chosen, rejected = _pair(chosen_rewards, rejected_rewards)
    real = _as_pair_vector(pair_mask, "pair_mask", chosen.shape) > 0
    per_pair = bradley_terry_loss(chosen, rejected, margin)
    if center_coefficient is not None:
        per_pair = per_pair + center_coefficient * centering_penalty(chosen, rejected)

    def total(values: Array) -> Array:
        return jnp.sum(jnp.where(real, values, 0.0))

    return {
        "loss": total(per_pair),
        "accuracy": total(pairwise_accuracy(chosen, rejected)),
        "margin": total(chosen - rejected),
        "chosen_reward": total(chosen),
        "rejected_reward": total(rejected),
        "reward_sq": total(jnp.square(chosen) + jnp.square(rejected)),
        "num_pairs": jnp.sum(real.astype(jnp.float32)),
    }


def metrics_from_sums(sums: dict[str, Array]) -> dict[str, Array]:
    """Means over the real pairs from `reward_metric_sums` (summed over microbatches).

    reward_std is the population std over all 2·n real rewards, from E[r²] − E[r]² (clamped at 0):
    of the usual formulas it is the one whose parts (Σr, Σr²) add across microbatches and devices.
    In float32 it loses precision when |mean reward| ≫ std (relative error of the variance about
    2⁻²⁴ · mean² / std²); a two-pass form would need the whole batch's mean before any sum.
    """
    n = jnp.maximum(sums["num_pairs"], 1.0)
    mean_reward = (sums["chosen_reward"] + sums["rejected_reward"]) / (2.0 * n)
    variance = sums["reward_sq"] / (2.0 * n) - jnp.square(mean_reward)
    return {
        "loss": sums["loss"] / n,
        "accuracy": sums["accuracy"] / n,
        "margin": sums["margin"] / n,
        "chosen_reward": sums["chosen_reward"] / n,
        "rejected_reward": sums["rejected_reward"] / n,
        "reward_std": jnp.sqrt(jnp.maximum(variance, 0.0)),
        "num_pairs": sums["num_pairs"],
    }


def combine_objectives(
    objective_losses: Mapping[str, Array], weights: Mapping[str, float]
) -> Array:
    """Weighted sum `Σ_k w_k · L_k` of several reduced objectives, matched by name.

    Linear scalarisation of a multi-objective reward model (one head per named objective, e.g.
    HelpSteer's helpfulness, correctness, coherence; Wang et al. 2023, "HelpSteer: Multi-attribute
    Helpfulness Dataset for SteerLM", arXiv:2311.09528). The sum is linear, so combining the
    per-objective sums of `reward_metric_sums`-style accumulation and dividing once is exact too.

    Args:
      objective_losses: name -> scalar loss (already reduced over rows).
      weights: name -> finite weight ≥ 0; exactly the names of `objective_losses`.

    Returns:
      scalar float32. Example: {"helpful": 0.5, "safe": 2.0} with weights {"helpful": 1.0,
      "safe": 0.25} -> 1.0 · 0.5 + 0.25 · 2.0 = 1.0.

    Raises:
      ConfigError: a name has a loss but no weight or a weight but no loss (a silently dropped
        objective would train a head nothing supervises), or a weight is negative or not finite.
    """
    missing = sorted(set(objective_losses) - set(weights))
    unknown = sorted(set(weights) - set(objective_losses))
    if missing or unknown:
        raise ConfigError(
            f"objective weights must name exactly the objectives {sorted(objective_losses)}: "
            f"no weight for {missing}, weight without an objective for {unknown}"
        )
    if not objective_losses:
        raise ConfigError("combine_objectives needs at least one objective")
    total = jnp.zeros((), jnp.float32)
    for name in sorted(objective_losses):  # sorted: the same float sum order on every process
        weight = float(weights[name])
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"objective weight {name}={weight} must be finite and ≥ 0")
        loss = jnp.asarray(objective_losses[name])
        if loss.ndim != 0:
            raise DataError(
                f"objective {name!r} has shape {loss.shape}; reduce it to a scalar first "
                "(masked_mean over its rows)"
            )
        # float32: an objective may come out of a bfloat16 head; adding in bfloat16 would round it.
        total = total + weight * loss.astype(jnp.float32)
    return total


# The losses over a group batch, and the target each one reads: `ranks` [B, K] (lower is better)
# for rows ranking K responses, `scores` [B, 1] for score rows.
RANKING_LOSSES = ("plackett_luce", "all_pairs_bradley_terry", "davidson")
SCORE_LOSSES = ("mse", "gaussian_nll")
GROUP_LOSSES = RANKING_LOSSES + SCORE_LOSSES


def group_metric_sums(
    rewards: Array,
    targets: Array,
    response_mask: Array,
    row_mask: Array,
    loss: str,
    log_variance: Array | None = None,
    log_tie_strength: float = 0.0,
) -> dict[str, Array]:
    """Sums over the real rows of one (micro)batch of groups, additive across microbatches and
    devices (`group_metrics_from_sums` divides once), as `reward_metric_sums` is for pairs.

    Args:
      rewards: [B, K] rewards (K = 1 for score rows).
      targets: [B, K] ranks (lower = better; ranking losses) or scores (score losses).
      response_mask: [B, K] 1 for real responses, 0 for padding.
      row_mask: [B] 1 for real rows, 0 for padding rows.
      loss: one of `GROUP_LOSSES`.
      log_variance: [B, K] predicted log σ² (gaussian_nll only).
      log_tie_strength: θ = log ν of Davidson's tie model (davidson only).

    Returns:
      scalars: loss (Σ per-row loss), num_rows, reward and reward_sq (Σ r, Σ r² over real
      responses), num_responses; for ranking losses also correct_pairs / num_ranked_pairs (the
      pairs the ranks imply, a tie in reward counting ½); for score losses squared_error
      (Σ (r − y)²).

    Example: rewards [[2, 1, 0]], ranks [[0, 1, 2]], loss plackett_luce -> loss 0.7209
    (`ranking_losses.plackett_luce_loss`), correct_pairs 3, num_ranked_pairs 3.
    """
    rewards = jnp.asarray(rewards).astype(jnp.float32)  # float32: see _as_pair_vector
    targets = jnp.asarray(targets).astype(jnp.float32)
    valid = jnp.asarray(response_mask) > 0
    real = _as_pair_vector(row_mask, "row_mask") > 0
    if rewards.ndim != 2 or targets.shape != rewards.shape or valid.shape != rewards.shape:
        raise DataError(
            f"group rewards {rewards.shape}, targets {targets.shape} and response_mask "
            f"{valid.shape} must all be [B, K]"
        )
    if loss == "plackett_luce":
        per_row = ranking_losses.plackett_luce_loss(rewards, targets, valid)
    elif loss == "all_pairs_bradley_terry":
        per_row = ranking_losses.all_pairs_bradley_terry_loss(rewards, targets, valid)
    elif loss == "davidson":
        per_row = ranking_losses.all_pairs_davidson_loss(rewards, targets, valid, log_tie_strength)
    elif loss == "mse":
        per_row = ranking_losses.mse_loss(rewards[:, 0], targets[:, 0])
    elif loss == "gaussian_nll":
        if log_variance is None:
            raise ConfigError("gaussian_nll needs the predicted log-variance (model.num_labels=2)")
        per_row = ranking_losses.gaussian_nll_loss(
            rewards[:, 0], targets[:, 0], jnp.asarray(log_variance)[:, 0].astype(jnp.float32)
        )
    else:
        raise ConfigError(f"unknown group loss {loss!r}; expected one of {GROUP_LOSSES}")
    in_row = valid & real[:, None]

    def total(values: Array, where: Array) -> Array:
        # where, not multiply: a padded entry may hold NaN.
        return jnp.sum(jnp.where(where, values, 0.0))

    sums = {
        "loss": total(per_row, real),
        "num_rows": jnp.sum(real.astype(jnp.float32)),
        "reward": total(rewards, in_row),
        "reward_sq": total(jnp.square(rewards), in_row),
        "num_responses": jnp.sum(in_row.astype(jnp.float32)),
    }
    if loss in RANKING_LOSSES:
        pair = in_row[:, :, None] & in_row[:, None, :] & (targets[:, :, None] < targets[:, None, :])
        diff = rewards[:, :, None] - rewards[:, None, :]
        wins = jnp.where(diff > 0, 1.0, jnp.where(diff == 0, 0.5, 0.0))
        sums["correct_pairs"] = total(wins, pair)
        sums["num_ranked_pairs"] = jnp.sum(pair.astype(jnp.float32))
    else:
        sums["squared_error"] = total(jnp.square(rewards[:, 0] - targets[:, 0]), real)
    return sums


def group_metrics_from_sums(sums: dict[str, Array]) -> dict[str, Array]:
    """Means from `group_metric_sums` (summed over microbatches): loss per real row, reward mean
    and population std over the real responses, num_rows; `accuracy` over the ranked pairs or
    `mse` over the score rows."""
    n = jnp.maximum(sums["num_rows"], 1.0)
    responses = jnp.maximum(sums["num_responses"], 1.0)
    mean_reward = sums["reward"] / responses
    variance = sums["reward_sq"] / responses - jnp.square(mean_reward)
    out = {
        "loss": sums["loss"] / n,
        "reward_mean": mean_reward,
        "reward_std": jnp.sqrt(jnp.maximum(variance, 0.0)),
        "num_rows": sums["num_rows"],
    }
    if "correct_pairs" in sums:
        out["accuracy"] = sums["correct_pairs"] / jnp.maximum(sums["num_ranked_pairs"], 1.0)
    if "squared_error" in sums:
        out["mse"] = sums["squared_error"] / n
    return out


def objective_metric_sums(
    outputs: Array,
    scores: Array,
    score_mask: Array,
    response_mask: Array,
    row_mask: Array,
    names: Sequence[str],
) -> dict[str, Array]:
    """`group_metric_sums` of a multi-objective head on named-score rows (K = 1), with `mse`
    per objective: output i against score i over the rows that score objective i.

    Args:
      outputs: [B, K, L] head outputs (output i predicts objective `names[i]`; output 0 is the
        reward); scores: [B, K, L] named scores (0 where not scored); score_mask: [B, K, L] 1
        where the row scores that objective; response_mask: [B, K]; row_mask: [B]; names: the
        L objective names.

    Returns:
      additive scalars: num_rows, reward, reward_sq, num_responses (as `group_metric_sums`, of
      output 0 over all real rows) and per objective `loss/NAME` (Σ (output − score)² over the
      rows that score it) and `num_rows/NAME` (those rows). `objective_metrics_from_sums`
      divides once, so accumulation and devices add up exactly.

    Example: outputs [[[1, 0]], [[2, 2]]], scores [[[0, 1]], [[1, 0]]], score_mask
    [[[1, 1]], [[1, 0]]] -> loss/a 1 + 1 = 2 over 2 rows, loss/b 1 over 1 row.
    """
    outputs = jnp.asarray(outputs).astype(jnp.float32)  # float32: see _as_pair_vector
    scores = jnp.asarray(scores).astype(jnp.float32)
    score_mask = jnp.asarray(score_mask).astype(jnp.float32)
    if outputs.ndim != 3 or outputs.shape[-1] < len(names) or scores.shape[-1] != len(names):
        raise DataError(
            f"head outputs {outputs.shape} and named scores {scores.shape} must be [B, K, L] with "
            f"L = {len(names)} objectives {list(names)}"
        )
    row_mask = _as_pair_vector(row_mask, "row_mask")
    base = group_metric_sums(outputs[..., 0], scores[..., 0], response_mask, row_mask, "mse")
    sums = {k: base[k] for k in ("num_rows", "reward", "reward_sq", "num_responses")}
    for i, name in enumerate(names):
        # Each objective's real rows: the rows that score it (K = 1: the row's one response).
        scored = row_mask * score_mask[:, 0, i]
        one = group_metric_sums(outputs[..., i], scores[..., i], response_mask, scored, "mse")
        sums[f"loss/{name}"] = one["loss"]
        sums[f"num_rows/{name}"] = one["num_rows"]
    return sums


def objective_metrics_from_sums(
    sums: dict[str, Array], weights: Mapping[str, float]
) -> dict[str, Array]:
    """Means from `objective_metric_sums` (summed over microbatches): per objective `mse/NAME`
    (its loss: the mean over the rows that score it), `loss` = `combine_objectives` of those
    with `weights`, reward mean and std of output 0, num_rows."""
    per_objective = {
        name: sums[f"loss/{name}"] / jnp.maximum(sums[f"num_rows/{name}"], 1.0) for name in weights
    }
    n_resp = jnp.maximum(sums["num_responses"], 1.0)
    mean_reward = sums["reward"] / n_resp
    variance = sums["reward_sq"] / n_resp - jnp.square(mean_reward)
    out = {
        "loss": combine_objectives(per_objective, weights),
        "reward_mean": mean_reward,
        "reward_std": jnp.sqrt(jnp.maximum(variance, 0.0)),
        "num_rows": sums["num_rows"],
    }
    for name, value in per_objective.items():
        out[f"mse/{name}"] = value
    return out
