"""RewardBench 1 and 2 scoring rules (`rewardax.rewardbench`) on hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rewardax import rewardbench as rb
from rewardax.data.rankings import response_rewards
from rewardax.data.sources import ListSource
from rewardax.errors import DataError


def test_rewardbench1_sections_weight_subsets_and_equalise_math_with_code():
    # alpacaeval-easy: right, tie (0: strict), so 0.5; mt-bench-med: right, 1.0;
    # math-prm: right, 1.0; hep-go: wrong, 0.0; "mine": not a RewardBench subset.
    chosen = np.array([1.0, 2.0, 3.0, 1.0, 0.0, 5.0])
    rejected = np.array([0.0, 2.0, 1.0, 0.0, 1.0, 0.0])
    subsets = ["alpacaeval-easy", "alpacaeval-easy", "mt-bench-med", "math-prm", "hep-go", "mine"]
    got = rb.rewardbench1_scores(chosen, rejected, subsets)
    assert got["subsets"]["alpacaeval-easy"] == 0.5
    # Chat: (0.5 x 100 + 1.0 x 40) / 140 = 0.642857; Reasoning: (1 x 984 + 0 x 164) / 1148.
    assert got["sections"]["Chat"] == pytest.approx(90 / 140)
    assert got["sections"]["Reasoning"] == pytest.approx(984 / 1148)
    assert set(got["sections"]) == {"Chat", "Reasoning"}
    assert got["score"] == pytest.approx((90 / 140 + 984 / 1148) / 2)
    assert got["other_subsets"] == ["mine"]
    # Math against all six code subsets: half and half.
    code = [f"hep-{lang}" for lang in ("cpp", "go", "java", "js", "python", "rust")]
    half = rb.rewardbench1_scores(np.ones(7), np.r_[0.0, np.full(6, 2.0)], ["math-prm", *code])
    assert half["sections"]["Reasoning"] == pytest.approx(0.5)
    assert rb.rewardbench1_scores(np.ones(2), np.zeros(2), ["even", "odd"]) is None


@pytest.mark.parametrize(
    ("chosen", "rejected", "want"),
    [([1.0], [1.0, 0.5, 0.2], 0.5), ([2.0], [1.0, 1.0, 0.0], 1.0), ([1.0], [2.0, 0.5, 0.1], 0.0)],
)
def test_best_of_n_shares_a_tie_at_the_top(chosen, rejected, want):
    assert rb.best_of_n(np.array(chosen), np.array(rejected)) == want


def _ties_groups():
    # Prompt 1: ref margin 3 - 1 = 2, tied margin 2.5 - 1 = 1.5, spread 0.5.
    # Prompt 2: ref margin 0 - 1 = -1 (inaccurate), tied margin 1 - 0.5 = 0.5, spread 1.
    a = np.array
    return {
        ("ref", 1): (a([3.0]), a([1.0, 0.5])),
        ("tied", 1): (a([3.0, 2.5]), a([1.0])),
        ("ref", 2): (a([0.0]), a([1.0])),
        ("tied", 2): (a([2.0, 1.0]), a([0.5])),
    }


def test_ties_score_golden_values():
    got = rb.ties_score(_ties_groups())
    assert (got["ref_accuracy"], got["tied_accuracy"]) == (0.5, 1.0)
    # Prompt 1: 1.5 > 0.5 and min(2, 1.5) > 0.5; prompt 2: 0.5 > 1 no, -1 > 1 no.
    assert (got["correctness_preferred"], got["correctness_preferred_hard"]) == (0.5, 0.5)
    # tanh(1.5 / 0.5 - 1) = tanh(2) and tanh(-1 / 1 - 1) = tanh(-2): mean 0.
    assert got["margin_score"] == pytest.approx(0.0, abs=1e-12)
    assert got["score"] == pytest.approx(0.3 * 1.0 + 0.3 * 0.5 + 0.2 * 0.5 + 0.2 * 0.5)
    only_first = {k: v for k, v in _ties_groups().items() if k[1] == 1}
    # 0.3 + 0.3 + 0.2 + 0.2 + 0.01 tanh(2) = 1.00964028: the reference's weights sum to 1.01.
    assert rb.ties_score(only_first)["score"] == pytest.approx(1.0 + 0.01 * math.tanh(2.0))
    # No prompt with both groups: accuracies only.
    alone = rb.ties_score({("ref", 1): _ties_groups()[("ref", 1)]})
    assert alone["score"] is None and alone["ref_accuracy"] == 1.0
    with pytest.raises(DataError, match="at least 2"):
        rb.ties_score({**only_first, ("tied", 1): (np.array([3.0]), np.array([1.0]))})


def _rb2_rows():
    return [
        {"prompt": "p0", "chosen": ["c0"], "rejected": ["r0", "r1", "r2"], "subset": "Focus"},
        {"prompt": "p1", "chosen": ["c1"], "rejected": ["r3", "r4", "r5"], "subset": "Focus"},
        {"prompt": "p2", "chosen": ["c2"], "rejected": ["r6", "r7", "r8"], "subset": "Math"},
        {"prompt": "q1", "chosen": ["a"], "rejected": ["b", "c"], "subset": "Ties", "id": "ref:1"},
        {"prompt": "q1", "chosen": ["a", "d"], "rejected": ["b"], "subset": "Ties", "id": "tied:1"},
    ]


def test_rewardbench2_pairs_cover_every_response_and_rewards_come_back():
    source = ListSource(_rb2_rows(), name="rb2.jsonl")
    pairs = rb.expand_rewardbench2(source)
    assert len(pairs) == 3 + 3 + 3 + 2 + 2  # every chosen over every rejected
    assert pairs[0]["chosen"] == "c0" and pairs[0]["rejected"] == "r0"
    assert pairs.where(12) == "rb2.jsonl[4] (response 1 over 2)"  # d over b
    # A reward per text, as a scorer would give; pairs 4 and 5 of row 1 dropped (unscored).
    value = {
        t: float(i)
        for i, t in enumerate(
            [
                "c0",
                "r0",
                "r1",
                "r2",
                "c1",
                "r3",
                "r4",
                "r5",
                "c2",
                "r6",
                "r7",
                "r8",
                "a",
                "b",
                "c",
                "d",
            ]
        )
    }
    kept = np.array([i for i in range(len(pairs)) if i not in (4, 5)])
    chosen = np.array([value[pairs[i]["chosen"]] for i in kept])
    rejected = np.array([value[pairs[i]["rejected"]] for i in kept])
    per_row = response_rewards(pairs, kept, chosen, rejected)
    assert per_row[1] is None  # r4 and r5 were in no scored pair
    np.testing.assert_array_equal(per_row[0], [0.0, 1.0, 2.0, 3.0])  # chosen first
    np.testing.assert_array_equal(per_row[4], [value["a"], value["d"], value["b"]])
    # A NaN reward is kept as a reward (the row is scored), not taken for "not set yet".
    poisoned = response_rewards(pairs, kept, np.where(kept == 0, np.nan, chosen), rejected)
    assert poisoned[0] is not None and np.isnan(poisoned[0][0]) and poisoned[0][1] == 1.0
    scores = rb.rewardbench2_scores(_rb2_rows(), per_row)
    # Focus: row 0 (c0 = 0 below r0..r2) scores 0, row 1 unscored; Math: c2 = 8 < r6 = 9: 0.
    assert scores["subsets"]["Focus"] == 0.0 and scores["num_rows"]["Focus"] == 1
    assert scores["num_unscored"] == 1
    # Ties: ref a = 12 vs b = 13, c = 14: margin -2; tied (a 12, d 15) vs b 13: margin -1.
    assert scores["ties"]["ref_accuracy"] == 0.0 and scores["ties"]["tied_accuracy"] == 0.0
    # spread 3: -1 > 3 no; min(-2, -1) > 3 no; tanh(-2 / 3 - 1).
    assert scores["ties"]["margin_score"] == pytest.approx(math.tanh(-2 / 3 - 1))
    ties = 0.01 * math.tanh(-2 / 3 - 1)
    assert scores["subsets"]["Ties"] == pytest.approx(ties)
    assert scores["score"] == pytest.approx((0.0 + 0.0 + ties) / 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chosen": []}, r"rb2.jsonl\[0\]: `chosen` must be a non-empty list"),
        ({"rejected": ["ok", 3]}, r"rb2.jsonl\[0\]: `rejected` must be a non-empty list"),
        ({"subset": None}, r"rb2.jsonl\[0\]: `subset` must be a non-empty string"),
        ({"subset": "Ties", "id": "7"}, r"rb2.jsonl\[0\]: a Ties row's `id` must be 'ref:N'"),
    ],
)
def test_bad_rewardbench2_rows_name_the_row_and_field(change, message):
    rows = _rb2_rows()
    rows[0] = {**rows[0], **change}
    with pytest.raises(DataError, match=message):
        rb.expand_rewardbench2(ListSource(rows, name="rb2.jsonl"))


def test_layout_detection():
    assert rb.is_rewardbench2(_rb2_rows()[0])
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert not rb.is_rewardbench2({"prompt": "p", "chosen": chat, "rejected": chat})
    assert not rb.is_rewardbench2({"prompt": "p", "chosen": "c", "rejected": "r"})
    # Lists of responses without a subset: a plain ranking, not RewardBench 2.
    assert not rb.is_rewardbench2({"prompt": "p", "chosen": ["c"], "rejected": ["r", "s"]})
