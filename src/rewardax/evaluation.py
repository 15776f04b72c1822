"""Diagnostics of a reward model from its rewards on preference pairs: pure numpy, no model needed.

`preference_metrics` takes the rewards a model gave to the chosen and the rejected response of each
pair and returns plain Python values (floats, ints, lists, dicts, None) so that the CLI can print them
as one JSON line and `rewardax.report` can draw them. Nothing in the result is NaN or Inf: a value that
is undefined for the input (the Spearman correlation of constant rewards, the accuracy of an empty
bucket) is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rewardax.errors import ConfigError, DataError

# A pair counts as "similar length" when |len_c - len_r| <= this fraction of the longer response.
SIMILAR_LENGTH_FRACTION = 0.1
LENGTH_BUCKETS = ("chosen_shorter", "similar_length", "chosen_longer")


def _as_vector(values: Any, name: str, n: int | None) -> np.ndarray:
    """`values` as a finite float64 vector of length `n` (any length when n is None), or DataError."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise DataError(
            f"{name} must be a 1-D array with one value per pair, got shape {array.shape}; "
            "pass one reward (or length) per pair, e.g. rewards[:, 0] for a [N, 2] array."
        )
    if n is not None and array.shape[0] != n:
        raise DataError(
            f"{name} has {array.shape[0]} values but chosen has {n}; every per-pair array must "
            "have one value per pair, in the same order."
        )
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise DataError(
            f"{name} has {bad.size} non-finite value(s) (NaN/Inf), the first at pair index "
            f"{int(bad[0])}; check the model's outputs (or the length column) for that row."
        )
    return array


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """σ(x) without overflow: exp is only ever taken of a non-positive number."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _win_fraction(margins: np.ndarray) -> np.ndarray:
    """Per pair: 1 when chosen scored higher, 0 when lower, ½ for an exact tie. [N] -> [N]."""
    return (margins > 0).astype(np.float64) + 0.5 * (margins == 0)


def _mean_or_none(values: np.ndarray) -> float | None:
    return float(values.mean()) if values.size else None


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of `values` [M] with tied values sharing the mean of their ranks. -> [M] float.

    Example: [10, 30, 20, 20] -> [1.0, 4.0, 2.5, 2.5].
    """
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    # The k-th distinct value occupies positions cumsum[k]-count[k]+1 .. cumsum[k]; its rank is their mean.
    last_position = np.cumsum(counts)
    group_rank = last_position - (counts - 1) / 2.0
    return group_rank[inverse.reshape(-1)].astype(np.float64)


def spearman_correlation(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman's ρ of two [M] vectors: the Pearson correlation of their average ranks.

    Returns None when it is undefined (fewer than two values, or either vector constant).
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if x.shape != y.shape:
        raise DataError(f"spearman_correlation needs equal lengths, got {x.size} and {y.size}.")
    if x.size < 2:
        return None
    rx = average_ranks(x)
    ry = average_ranks(y)
    rx -= rx.mean()
    ry -= ry.mean()
    denominator = np.sqrt(np.sum(rx * rx) * np.sum(ry * ry))
    if denominator == 0.0:
        return None
    # Rounding can push |ρ| a hair past 1 for perfectly (anti-)monotone data.
    return float(np.clip(np.sum(rx * ry) / denominator, -1.0, 1.0))


def calibration_table(margins: np.ndarray, num_bins: int = 10) -> dict[str, Any]:
    """Calibration of p = σ(r_c − r_r), read as the probability that the chosen response is preferred.

    The model predicts "chosen" when p > ½ and "rejected" when p < ½, with confidence
    c = max(p, 1 − p) ∈ [½, 1]; an exact tie (p = ½) counts as half correct, as in `accuracy`. The
    confidences are split into `num_bins` equal-width bins over [½, 1] (a binary prediction is never
    less than ½ confident, so bins over [0, ½) would always be empty); bins are half-open
    [lo, hi) except the last, which includes 1. With B_m the pairs in bin m and N the pair count,

        ECE = Σ_m |B_m| / N · |acc(B_m) − conf(B_m)|

    (Guo et al. 2017, "On Calibration of Modern Neural Networks"), acc = mean correctness and
    conf = mean confidence in the bin. The Brier score is mean((p − 1)²): the label is always
    "chosen preferred", so the target probability is 1.

    Args:
        margins: [N] r_c − r_r per pair.
        num_bins: number of confidence bins.

    Returns:
        {"ece": float, "brier": float, "bins": [{"lower", "upper", "count", "confidence",
        "accuracy"}, ...]} with one entry per bin; confidence/accuracy are None for an empty bin.
    """
    if not isinstance(num_bins, int) or isinstance(num_bins, bool) or num_bins < 1:
        raise ConfigError(f"num_bins must be a positive integer, got {num_bins!r}.")
    margins = np.asarray(margins, dtype=np.float64)
    n = margins.size
    confidence = _sigmoid(np.abs(margins))
    correct = _win_fraction(margins)
    width = 0.5 / num_bins
    index = np.clip(np.floor((confidence - 0.5) / width).astype(np.int64), 0, num_bins - 1)
    bins = []
    ece = 0.0
    for m in range(num_bins):
        in_bin = index == m
        count = int(in_bin.sum())
        mean_conf = _mean_or_none(confidence[in_bin])
        mean_acc = _mean_or_none(correct[in_bin])
        if count:
            ece += count / n * abs(mean_acc - mean_conf)
        bins.append(
            {
                "lower": 0.5 + m * width,
                "upper": 0.5 + (m + 1) * width,
                "count": count,
                "confidence": mean_conf,
                "accuracy": mean_acc,
            }
        )
    # 1 − σ(d) = σ(−d): no cancellation when p is close to 1.
    brier = float(np.mean(_sigmoid(-margins) ** 2)) if n else None
    return {"ece": float(ece) if n else None, "brier": brier, "bins": bins}


def length_bias(
    chosen: np.ndarray,
    rejected: np.ndarray,
    chosen_lengths: np.ndarray,
    rejected_lengths: np.ndarray,
) -> dict[str, Any]:
    """Does the model reward length? All arguments are [N] per pair.

    Returns:
        length_spearman: Spearman ρ between reward and length over all 2N responses (None when
            undefined: constant rewards or constant lengths).
        chosen_length_mean / rejected_length_mean: float, so the data's own bias is visible.
        length_buckets: accuracy per bucket of the length difference. A pair is "similar_length"
            when |len_c − len_r| <= 10% of max(len_c, len_r) (`SIMILAR_LENGTH_FRACTION`), else
            "chosen_longer" or "chosen_shorter". Each entry: {"bucket", "count", "accuracy"
            (None when empty), "mean_length_difference" (len_c − len_r, None when empty)}.
    """
    rewards = np.concatenate([chosen, rejected])
    lengths = np.concatenate([chosen_lengths, rejected_lengths])
    difference = chosen_lengths - rejected_lengths
    longer = np.maximum(np.maximum(chosen_lengths, rejected_lengths), 1e-12)
    similar = np.abs(difference) <= SIMILAR_LENGTH_FRACTION * longer
    masks = {
        "chosen_shorter": (difference < 0) & ~similar,
        "similar_length": similar,
        "chosen_longer": (difference > 0) & ~similar,
    }
    wins = _win_fraction(chosen - rejected)
    buckets = [
        {
            "bucket": name,
            "count": int(masks[name].sum()),
            "accuracy": _mean_or_none(wins[masks[name]]),
            "mean_length_difference": _mean_or_none(difference[masks[name]]),
        }
        for name in LENGTH_BUCKETS
    ]
    return {
        "length_spearman": spearman_correlation(rewards, lengths),
        "chosen_length_mean": float(chosen_lengths.mean()),
        "rejected_length_mean": float(rejected_lengths.mean()),
        "length_buckets": buckets,
    }


def preference_metrics(
    chosen: np.ndarray,
    rejected: np.ndarray,
    *,
    margin: np.ndarray | None = None,
    chosen_lengths: np.ndarray | None = None,
    rejected_lengths: np.ndarray | None = None,
    subsets: Sequence[str] | None = None,
    num_bins: int = 10,
) -> dict[str, Any]:
    """Accuracy, loss, calibration, length bias and per-subset accuracy of rewards on N pairs.

    Args:
        chosen: [N] reward of each chosen (preferred) response.
        rejected: [N] reward of each rejected response, same pair order.
        margin: [N] optional per-pair margin m of the loss −log σ(r_c − r_r − m) (Llama-2 style);
            it changes `loss` only: accuracy is whether r_c > r_r.
        chosen_lengths, rejected_lengths: [N] optional response lengths (tokens or characters);
            give both or neither. Adds the `length_bias` keys.
        subsets: N optional labels (RewardBench's `subset` column). Adds `subsets`.
        num_bins: confidence bins for the ECE (see `calibration_table`).

    Returns:
        A JSON-serialisable dict without NaN:
        num_pairs (int), num_ties (int), accuracy (ties count ½), loss (mean −log σ(r_c − r_r − m)),
        mean_margin (mean r_c − r_r), chosen_reward_mean/std, rejected_reward_mean/std,
        reward_mean/std (over all 2N rewards; std is the population std, ddof=0),
        ece, brier, calibration_bins (list, see `calibration_table`);
        with lengths: length_spearman (float or None), chosen_length_mean, rejected_length_mean,
        length_buckets (list, see `length_bias`);
        with subsets: subsets = {name: {"accuracy": float, "num_pairs": int}}, names sorted.

    Example:
        >>> m = preference_metrics(np.array([2.0, 1.0, 0.0, 0.0]), np.array([1.0, 0.0, 0.0, 1.0]))
        >>> m["accuracy"]  # two wins, one tie, one loss
        0.625
    """
    chosen_v = _as_vector(chosen, "chosen rewards", None)
    n = chosen_v.shape[0]
    if n == 0:
        raise DataError("No pairs to evaluate: chosen rewards are empty; check the eval data file.")
    rejected_v = _as_vector(rejected, "rejected rewards", n)
    margin_v = np.zeros(n) if margin is None else _as_vector(margin, "margin", n)

    differences = chosen_v - rejected_v
    wins = _win_fraction(differences)
    # −log σ(z) = log(1 + e^{−z}) = softplus(−z); logaddexp never overflows.
    losses = np.logaddexp(0.0, -(differences - margin_v))
    all_rewards = np.concatenate([chosen_v, rejected_v])
    calibration = calibration_table(differences, num_bins)

    result: dict[str, Any] = {
        "num_pairs": int(n),
        "num_ties": int(np.sum(differences == 0)),
        "accuracy": float(wins.mean()),
        "loss": float(losses.mean()),
        "mean_margin": float(differences.mean()),
        "chosen_reward_mean": float(chosen_v.mean()),
        "chosen_reward_std": float(chosen_v.std()),
        "rejected_reward_mean": float(rejected_v.mean()),
        "rejected_reward_std": float(rejected_v.std()),
        "reward_mean": float(all_rewards.mean()),
        "reward_std": float(all_rewards.std()),
        "ece": calibration["ece"],
        "brier": calibration["brier"],
        "calibration_bins": calibration["bins"],
    }

    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ConfigError(
            "Give both chosen_lengths and rejected_lengths, or neither: length bias compares them."
        )
    if chosen_lengths is not None:
        chosen_len = _as_vector(chosen_lengths, "chosen_lengths", n)
        rejected_len = _as_vector(rejected_lengths, "rejected_lengths", n)
        for name, lengths in (("chosen_lengths", chosen_len), ("rejected_lengths", rejected_len)):
            if np.any(lengths < 0):
                first = int(np.flatnonzero(lengths < 0)[0])
                raise DataError(f"{name} has a negative length at pair index {first}.")
        result.update(length_bias(chosen_v, rejected_v, chosen_len, rejected_len))

    if subsets is not None:
        labels = [str(s) for s in subsets]
        if len(labels) != n:
            raise DataError(
                f"subsets has {len(labels)} labels but there are {n} pairs; give one `subset` "
                "value per pair, in the same order."
            )
        label_array = np.asarray(labels, dtype=object)
        result["subsets"] = {
            name: {
                "accuracy": float(wins[label_array == name].mean()),
                "num_pairs": int(np.sum(label_array == name)),
            }
            for name in sorted(set(labels))
        }
    return result


def reward_normalization(rewards: np.ndarray) -> dict[str, float]:
    """Mean and std of rewards, to store with an exported model for `score --normalize`.

    Computed once, at the end of training, over the eval rewards (chosen and rejected together),
    so a deployed model has one fixed normalisation rather than one that drifts with each eval.

    Args:
        rewards: any shape, e.g. [2N] or [N, 2]; flattened.

    Returns:
        {"mean": float, "std": float}; std is the population std (ddof=0) and is 0.0 for constant
        rewards: a consumer dividing by it must guard against that.
    """
    flat = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if flat.size == 0:
        raise DataError("Cannot compute a reward normalisation from zero rewards.")
    flat = _as_vector(flat, "rewards", None)
    return {"mean": float(flat.mean()), "std": float(flat.std())}
