"""Values of the evaluation diagnostics, checked against hand arithmetic and scipy."""

import json
import math

import numpy as np
import pytest

from rewardax.errors import ConfigError, DataError
from rewardax.evaluation import (
    average_ranks,
    calibration_table,
    preference_metrics,
    reward_normalization,
    spearman_correlation,
)


def test_accuracy_counts_ties_as_half():
    # Pairs: 2>1 win, 1>0 win, 0=0 tie, 0<1 loss -> (1 + 1 + 0.5 + 0) / 4 = 0.625.
    m = preference_metrics([2.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0])
    assert m["accuracy"] == pytest.approx(0.625)
    assert m["num_ties"] == 1
    assert m["num_pairs"] == 4
    # Margins 1, 1, 0, -1 -> mean 0.25.
    assert m["mean_margin"] == pytest.approx(0.25)


def test_loss_hand_computed_with_and_without_margin():
    ln3 = math.log(3.0)
    # d = +ln3: −log σ(ln3) = −log(3/4) = log(4/3); d = −ln3: −log σ(−ln3) = −log(1/4) = log 4.
    m = preference_metrics([ln3, 0.0], [0.0, ln3])
    assert m["loss"] == pytest.approx((math.log(4 / 3) + math.log(4)) / 2)
    # A margin of ln3 on the first pair: −log σ(ln3 − ln3) = log 2; second pair unchanged.
    m = preference_metrics([ln3, 0.0], [0.0, ln3], margin=[ln3, 0.0])
    assert m["loss"] == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert m["accuracy"] == 0.5  # the margin never changes accuracy


def test_loss_is_stable_for_huge_margins():
    m = preference_metrics([1000.0, -1000.0], [-1000.0, 1000.0])
    # Pair 1: log(1 + e^-2000) ~ 0; pair 2: log(1 + e^2000) ~ 2000. Mean ~ 1000, finite.
    assert m["loss"] == pytest.approx(1000.0)
    assert m["brier"] == pytest.approx(0.5)


def test_reward_statistics():
    m = preference_metrics([1.0, 3.0], [0.0, 0.0])
    assert m["chosen_reward_mean"] == 2.0
    assert m["chosen_reward_std"] == 1.0  # population std of [1, 3]
    assert m["rejected_reward_mean"] == 0.0
    assert m["rejected_reward_std"] == 0.0
    # All four rewards [1, 3, 0, 0]: mean 1, variance (0 + 4 + 1 + 1) / 4 = 1.5.
    assert m["reward_mean"] == 1.0
    assert m["reward_std"] == pytest.approx(math.sqrt(1.5))


def test_ece_and_brier_hand_computed():
    ln3, ln17_3 = math.log(3.0), math.log(17 / 3)
    # p = σ(d) = [0.75, 0.25, 0.75, 0.85, 0.5]; confidence max(p, 1 − p) = [.75, .75, .75, .85, .5].
    # Correct: [1, 0, 1, 1, ½] (tie). Five bins over [0.5, 1], width 0.1:
    #   bin 0 [0.5, 0.6): {0.5 tie}  conf 0.5,  acc 0.5 -> gap 0
    #   bin 2 [0.7, 0.8): three 0.75 conf 0.75, acc 2/3 -> gap 1/12
    #   bin 3 [0.8, 0.9): {0.85}     conf 0.85, acc 1   -> gap 0.15
    # ECE = (1·0 + 3·(1/12) + 1·0.15) / 5 = 0.4 / 5 = 0.08.
    # Brier = mean((p − 1)²) = (0.0625 + 0.5625 + 0.0625 + 0.0225 + 0.25) / 5 = 0.96 / 5 = 0.192.
    d = np.array([ln3, -ln3, ln3, ln17_3, 0.0])
    m = preference_metrics(d, np.zeros(5), num_bins=5)
    assert m["ece"] == pytest.approx(0.08)
    assert m["brier"] == pytest.approx(0.192)
    assert m["accuracy"] == pytest.approx(0.7)
    bins = m["calibration_bins"]
    assert [b["count"] for b in bins] == [1, 0, 3, 1, 0]
    assert bins[1]["accuracy"] is None and bins[1]["confidence"] is None
    assert bins[2]["accuracy"] == pytest.approx(2 / 3)
    assert bins[2]["confidence"] == pytest.approx(0.75)
    assert bins[3]["lower"] == pytest.approx(0.8) and bins[3]["upper"] == pytest.approx(0.9)


def test_calibration_bins_reproduce_accuracy_and_put_certainty_in_last_bin():
    rng = np.random.default_rng(0)
    d = rng.normal(size=200) * 3
    d[0] = 50.0  # confidence rounds to exactly 1.0: must land in the last bin, not past it
    table = calibration_table(d, num_bins=10)
    counts = np.array([b["count"] for b in table["bins"]])
    assert counts.sum() == 200
    weighted = sum(b["count"] * b["accuracy"] for b in table["bins"] if b["count"])
    assert weighted / 200 == pytest.approx(float(np.mean(d > 0)))
    assert table["bins"][-1]["count"] >= 1


def test_bad_num_bins_is_a_config_error():
    with pytest.raises(ConfigError, match="num_bins"):
        preference_metrics([1.0], [0.0], num_bins=0)


def test_average_ranks_share_ties():
    np.testing.assert_allclose(average_ranks(np.array([10, 30, 20, 20])), [1, 4, 2.5, 2.5])


def test_spearman_hand_computed_with_ties():
    # Rewards over all responses (chosen then rejected): [1, 3, 2, 2] -> ranks [1, 4, 2.5, 2.5].
    # Lengths [10, 30, 20, 40] -> ranks [1, 3, 2, 4]. Centred (mean 2.5):
    # dx = [-1.5, 1.5, 0, 0], dy = [-1.5, 0.5, -0.5, 1.5]; Σdxdy = 2.25 + 0.75 = 3,
    # Σdx² = 4.5, Σdy² = 5 -> ρ = 3 / sqrt(22.5) = 2 / sqrt(10).
    m = preference_metrics(
        [1.0, 3.0], [2.0, 2.0], chosen_lengths=[10, 30], rejected_lengths=[20, 40]
    )
    assert m["length_spearman"] == pytest.approx(2 / math.sqrt(10))
    assert m["chosen_length_mean"] == 20.0
    assert m["rejected_length_mean"] == 30.0


def test_spearman_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 8, size=60).astype(float)  # many ties
    y = x + rng.normal(size=60)
    y[::7] = 3.0
    expected = stats.spearmanr(x, y).statistic
    assert spearman_correlation(x, y) == pytest.approx(expected, abs=1e-12)


def test_spearman_undefined_is_none():
    assert spearman_correlation(np.ones(5), np.arange(5)) is None
    assert spearman_correlation(np.array([1.0]), np.array([2.0])) is None
    assert spearman_correlation(np.arange(5), -np.arange(5.0)) == -1.0


def test_length_buckets():
    # len_c − len_r and the 10%-of-longer rule:
    #   100 vs 50 -> +50 longer (win), 100 vs 95 -> +5 <= 10 similar (loss),
    #   40 vs 80 -> shorter (tie), 20 vs 80 -> shorter (win), 60 vs 20 -> longer (win).
    chosen = [1.0, 0.0, 0.5, 2.0, 3.0]
    rejected = [0.0, 1.0, 0.5, 1.0, 0.0]
    m = preference_metrics(
        chosen,
        rejected,
        chosen_lengths=[100, 100, 40, 20, 60],
        rejected_lengths=[50, 95, 80, 80, 20],
    )
    buckets = {b["bucket"]: b for b in m["length_buckets"]}
    assert buckets["chosen_longer"]["count"] == 2
    assert buckets["chosen_longer"]["accuracy"] == 1.0
    assert buckets["chosen_longer"]["mean_length_difference"] == 45.0
    assert buckets["similar_length"]["count"] == 1
    assert buckets["similar_length"]["accuracy"] == 0.0
    assert buckets["chosen_shorter"]["count"] == 2
    assert buckets["chosen_shorter"]["accuracy"] == 0.75  # (tie ½ + win 1) / 2


def test_lengths_must_come_in_pairs():
    with pytest.raises(ConfigError, match="both"):
        preference_metrics([1.0], [0.0], chosen_lengths=[3])


def test_per_subset_accuracy():
    m = preference_metrics(
        [1.0, 0.0, 2.0, 1.0, 1.0],
        [0.0, 1.0, 1.0, 1.0, 0.0],
        subsets=["chat", "chat", "safety", "safety", "safety"],
    )
    assert m["subsets"] == {
        "chat": {"accuracy": 0.5, "num_pairs": 2},
        "safety": {"accuracy": pytest.approx(2.5 / 3), "num_pairs": 3},
    }
    with pytest.raises(DataError, match="subsets has 1 labels"):
        preference_metrics([1.0, 0.0], [0.0, 1.0], subsets=["a"])


@pytest.mark.parametrize(
    ("chosen", "rejected"),
    [([0.3], [0.1]), ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]), ([2.0, 2.0], [2.0, 2.0])],
    ids=["one_pair", "all_ties", "constant"],
)
def test_edge_cases_are_json_and_nan_free(chosen, rejected):
    n = len(chosen)
    m = preference_metrics(
        chosen,
        rejected,
        chosen_lengths=[5] * n,
        rejected_lengths=[7] * n,
        subsets=["x"] * n,
    )
    text = json.dumps(m, allow_nan=False)  # raises on NaN/Inf or numpy types
    assert json.loads(text) == m
    if chosen == rejected:
        assert m["accuracy"] == 0.5
        assert m["loss"] == pytest.approx(math.log(2))
        assert m["ece"] == 0.0  # confidence ½, half correct
        assert m["brier"] == 0.25
        assert m["length_spearman"] is None  # constant rewards: undefined


def test_bad_inputs_name_the_array():
    with pytest.raises(DataError, match=r"rejected rewards has 1 values but chosen has 2"):
        preference_metrics([1.0, 2.0], [1.0])
    with pytest.raises(DataError, match=r"chosen rewards has 1 non-finite.*index 1"):
        preference_metrics([1.0, float("nan")], [0.0, 0.0])
    with pytest.raises(DataError, match="1-D"):
        preference_metrics(np.zeros((2, 2)), np.zeros((2, 2)))
    with pytest.raises(DataError, match="empty"):
        preference_metrics([], [])
    with pytest.raises(DataError, match="negative length at pair index 0"):
        preference_metrics([1.0], [0.0], chosen_lengths=[-1], rejected_lengths=[2])


def test_reward_normalization():
    # [1, 2, 3, 6]: mean 3, variance (4 + 1 + 0 + 9) / 4 = 3.5.
    norm = reward_normalization(np.array([[1.0, 2.0], [3.0, 6.0]]))
    assert norm == {"mean": 3.0, "std": pytest.approx(math.sqrt(3.5))}
    assert isinstance(norm["mean"], float) and isinstance(norm["std"], float)
    assert reward_normalization([4.0, 4.0]) == {"mean": 4.0, "std": 0.0}
    with pytest.raises(DataError):
        reward_normalization([])
    with pytest.raises(DataError, match="non-finite"):
        reward_normalization([1.0, float("inf")])
