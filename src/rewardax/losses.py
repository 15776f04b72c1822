"""Reward-model losses and metrics: pure functions of per-pair rewards.

Shapes: B is the number of pairs in a batch (padding pairs included, flagged by `pair_mask`).
Per-pair functions return `[B]` float32 values; the reduction over pairs happens in one place,
`masked_mean` (or the sum/finish pair used for gradient accumulation), so that padding pairs never
count and a sharded batch is averaged per example over all devices, not per device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rewardax.errors import DataError

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

    reward_std is the population std over all 2·n real rewards, from E[r²] − E[r]² (clamped at 0).
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


def reward_loss_and_metrics(
    chosen_rewards: Array,
    rejected_rewards: Array,
    margin: Array | None,
    pair_mask: Array,
    center_coefficient: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The training objective of one batch and its metrics, over the real pairs only.

    loss = masked_mean(bradley_terry_loss) + c · masked_mean(centering_penalty).

    Args:
      chosen_rewards, rejected_rewards: [B] rewards.
      margin: [B] or None.
      pair_mask: [B] 1.0 for real pairs, 0.0 for padding pairs.
      center_coefficient: c, or None to leave the centering term out.

    Returns:
      (loss scalar float32, metrics) with scalar metrics loss, accuracy (ties ½), margin (mean
      r_c − r_r), chosen_reward, rejected_reward (means), reward_std (over all 2·n real rewards)
      and num_pairs.
    """
    chosen, rejected = _pair(chosen_rewards, rejected_rewards)
    mask = _as_pair_vector(pair_mask, "pair_mask", chosen.shape)
    loss = masked_mean(bradley_terry_loss(chosen, rejected, margin), mask)
    if center_coefficient is not None:
        loss = loss + center_coefficient * masked_mean(centering_penalty(chosen, rejected), mask)
    mean_reward = (masked_mean(chosen, mask) + masked_mean(rejected, mask)) / 2.0
    # Two-pass variance (deviations from the mean) avoids E[r²] − E[r]² cancellation.
    deviation = (jnp.square(chosen - mean_reward) + jnp.square(rejected - mean_reward)) / 2.0
    metrics = {
        "loss": loss,
        "accuracy": masked_mean(pairwise_accuracy(chosen, rejected), mask),
        "margin": masked_mean(chosen - rejected, mask),
        "chosen_reward": masked_mean(chosen, mask),
        "rejected_reward": masked_mean(rejected, mask),
        "reward_std": jnp.sqrt(masked_mean(deviation, mask)),
        "num_pairs": jnp.sum((mask > 0).astype(jnp.float32)),
    }
    return loss, metrics
