"""Rows ranking K responses, read as the pairs of their rankings (`rewardax.data.rankings`)."""

from __future__ import annotations

import numpy as np
import pytest

from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax.data import DataConfig, ListSource
from rewardax.data.rankings import RankedPairs, rankings_as_pairs
from rewardax.errors import DataError

CHAT = [{"role": "user", "content": "Rate it"}, {"role": "assistant", "content": "Fine."}]


def test_ranks_give_every_better_worse_pair_and_ties_none():
    rows = [
        {"prompt": "P: ", "responses": ["b", "a", "c"], "ranks": [2, 1, 3], "subset": "s"},
        {"prompt": "Q: ", "responses": ["x", "y", "z"], "ranks": [1, 1, 2]},  # x and y tie
    ]
    pairs = rankings_as_pairs(ListSource(rows, name="ranked.jsonl"))
    assert isinstance(pairs, RankedPairs) and len(pairs) == 3 + 2
    got = [(p["prompt"], p["chosen"], p["rejected"]) for p in (pairs[i] for i in range(len(pairs)))]
    assert got == [
        ("P: ", "b", "c"),
        ("P: ", "a", "b"),
        ("P: ", "a", "c"),
        ("Q: ", "x", "z"),
        ("Q: ", "y", "z"),
    ]
    assert pairs[0]["subset"] == "s" and "ranks" not in pairs[0] and "responses" not in pairs[0]
    assert pairs.where(4) == "ranked.jsonl[1] (response 1 over 2)"
    np.testing.assert_array_equal(pairs.origin[:, 0], [0, 0, 0, 1, 1])


def test_chosen_and_rejected_lists_give_each_chosen_over_each_rejected():
    rows = [{"prompt": "P", "chosen": ["c0", CHAT], "rejected": ["r0", "r1", "r2"]}]
    pairs = rankings_as_pairs(ListSource(rows))
    assert len(pairs) == 6
    assert (pairs[0]["chosen"], pairs[0]["rejected"]) == ("c0", "r0")
    assert (pairs[5]["chosen"], pairs[5]["rejected"]) == (CHAT, "r2")


def test_pair_rows_are_left_alone():
    standard = ListSource([{"prompt": "p", "chosen": "a", "rejected": "b"}])
    conversational = ListSource([{"chosen": CHAT, "rejected": CHAT}])
    assert rankings_as_pairs(standard) is standard
    assert rankings_as_pairs(conversational) is conversational


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"responses": ["a"], "ranks": [1]}, "at least 2 responses"),
        ({"responses": ["a", "b"], "ranks": [1]}, r"`ranks` must be a list of 2 numbers"),
        ({"responses": ["a", "b"], "ranks": [True, False]}, r"`ranks` must be a list of 2"),
        ({"responses": ["a", ""], "ranks": [1, 2]}, "every item of `responses`"),
        ({"prompt": "p", "chosen": "a", "rejected": "b"}, "decided by its first row"),
        ({"chosen": [], "rejected": ["b"]}, "decided by its first row"),
    ],
)
def test_bad_rows_name_the_row(row, message):
    rows = [{"responses": ["a", "b"], "ranks": [1, 2]}, row]
    with pytest.raises(DataError, match=rf"data\.jsonl\[1\].*{message}"):
        rankings_as_pairs(ListSource(rows, name="data.jsonl"))


def test_a_ranking_scores_as_its_pairs_written_out():
    """Rewards of a ranked source through the eval pipeline equal those of the same pairs
    written as pair rows (the loader reads rankings as pairs)."""
    import jax

    from rewardax.pair_scoring import PairScorer
    from rewardax.sharding import make_mesh

    tokenizer = smollm2_tokenizer()
    ranked = [
        {
            "prompt": "Review: ",
            "responses": ["Great.", "Bad.", "Fine, I guess."],
            "ranks": [1, 3, 2],
        },
        {"prompt": "Review: ", "chosen": ["Lovely."], "rejected": ["Awful.", "Dull."]},
    ]
    written = [
        {"prompt": "Review: ", "chosen": c, "rejected": r}
        for c, r in [
            ("Great.", "Bad."),
            ("Great.", "Fine, I guess."),
            ("Fine, I guess.", "Bad."),
        ]
    ]
    lists = [
        {"prompt": "Review: ", "chosen": "Lovely.", "rejected": r} for r in ("Awful.", "Dull.")
    ]
    scorer, arrays = PairScorer.for_model(
        tiny_llama(tokenizer),
        mesh=make_mesh(1, 1, 1, devices=jax.devices()[:1]),
        tokenizer=tokenizer,
        data_config=DataConfig(max_sequence_length=32),
        batch_size=4,
    )
    got = scorer(arrays, ranked[:1])
    want = scorer(arrays, written)
    # Pair order: (a, b) for a, b in index order with rank[a] < rank[b].
    order = [0, 1, 2]  # Great > Bad, Great > Fine, Fine > Bad
    np.testing.assert_allclose(got.chosen, want.chosen[order], atol=1e-5)
    np.testing.assert_allclose(got.rejected, want.rejected[order], atol=1e-5)
    got_lists, want_lists = scorer(arrays, ranked[1:]), scorer(arrays, lists)
    np.testing.assert_allclose(got_lists.chosen, want_lists.chosen, atol=1e-5)
    np.testing.assert_allclose(got_lists.rejected, want_lists.rejected, atol=1e-5)


def test_the_trainer_trains_on_ranked_rows(tmp_path):
    import math

    import rewardax as rx

    tokenizer = smollm2_tokenizer()
    words = ["Great.", "Good.", "Fine.", "Bad.", "Awful.", "Dull.", "Lovely.", "Meh."]
    rows = [
        {"prompt": "Review: ", "responses": words[i : i + 3], "ranks": [1, 2, 3]} for i in range(6)
    ]
    config = rx.RewardConfig(
        per_device_train_batch_size=4,
        max_sequence_length=16,
        max_training_steps=2,
        save_directory=str(tmp_path),
        progress_bar=False,
    )
    trainer = rx.RewardTrainer(config, tokenizer, model=tiny_llama(tokenizer), train_dataset=rows)
    assert len(trainer.train_loader.source) == 6 * 3  # 3 pairs per ranking of 3
    result = trainer.train()
    assert math.isfinite(result.metrics["train"]["loss"])
    assert result.metrics["train"]["num_pairs"] == 4


def test_an_unreadable_line_in_a_ranked_file_is_named(tmp_path):
    from rewardax.data import ShardedDataSource

    path = tmp_path / "ranked.jsonl"
    good = '{"responses": ["a", "b"], "ranks": [1, 2]}\n'
    path.write_text("{oops\n" + good + good + "{\n")
    # The layout comes from the first readable row (line 2); the scan names the first broken line.
    with pytest.raises(DataError, match=r"ranked\.jsonl:1 \(row 0\): .*not valid JSON"):
        rankings_as_pairs(ShardedDataSource(str(path)))
    path.write_text(good + good + "{\n")
    with pytest.raises(DataError, match=r"ranked\.jsonl:3 \(row 2\): .*not valid JSON"):
        rankings_as_pairs(ShardedDataSource(str(path)))


def test_ranking_metrics_hand_values():
    from rewardax.data.rankings import kendall_tau, ranking_metrics

    rows = [{"ranks": [1, 2, 3]}] * 3
    rewards = [np.array([3.0, 2.0, 1.0]), np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 1.0])]
    # Row 3: τ-b = (0 + 1 + 1) / sqrt(2 x 3) (one reward tie); ρ of average ranks [2.5, 2.5, 1]
    # against [3, 2, 1] = 1.5 / sqrt(1.5 x 2); the top is shared by the best response: 1/2.
    assert kendall_tau(rewards[2], -np.array([1.0, 2.0, 3.0])) == pytest.approx(2 / 6**0.5)
    got = ranking_metrics(rows, rewards)
    assert got["num_rows"] == 3
    assert got["spearman"] == pytest.approx((1 - 1 + 1.5 / 3**0.5) / 3)
    assert got["kendall_tau"] == pytest.approx((1 - 1 + 2 / 6**0.5) / 3)
    assert got["top1_accuracy"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert ranking_metrics(rows[:1], [None])["num_rows"] == 0
    assert "loss" not in got  # no ranking loss asked for


def test_ranking_metrics_report_the_trained_ranking_loss_per_row():
    from rewardax.data.rankings import ranking_metrics

    # Plackett-Luce of rewards [2, 1, 0] in rank order: log(1 + e^-1 + e^-2) + log(1 + e^-1)
    # = 0.7209; of [0, 1] in rank order (the worse one first): log(1 + e^1) = 1.3133.
    rows = [{"ranks": [0, 1, 2]}, {"ranks": [0, 1]}, {"ranks": [0, 1]}]
    rewards = [np.array([2.0, 1.0, 0.0]), np.array([0.0, 1.0]), None]
    got = ranking_metrics(rows, rewards, "plackett_luce")
    want = (np.log(1 + np.exp(-1) + np.exp(-2)) + np.log(1 + np.exp(-1)) + np.log(1 + np.e)) / 2
    assert got["num_rows"] == 2 and got["loss"] == pytest.approx(want, rel=1e-6)
    # One pair: all-pairs Bradley-Terry is -log σ(0 - 1); Davidson's with ν = 1 (θ = 0) is
    # -log(π_c / (π_c + π_r + ν √(π_c π_r))) with π = e^r.
    pair = [{"ranks": [0, 1]}], [np.array([0.0, 1.0])]
    bt = np.log(1 + np.e)
    assert ranking_metrics(*pair, "all_pairs_bradley_terry")["loss"] == pytest.approx(bt)
    assert ranking_metrics(*pair, "davidson", log_tie_strength=0.0)["loss"] == pytest.approx(
        np.log(1 + np.e + np.sqrt(np.e)), rel=1e-6
    )
    assert ranking_metrics(rows, [None] * 3, "plackett_luce")["loss"] is None
    # A NaN reward (a diverged model) makes every mean NaN instead of leaving its row out.
    diverged = ranking_metrics(rows, [np.array([2.0, np.nan, 0.0]), *rewards[1:]], "plackett_luce")
    assert diverged["num_rows"] == 2
    assert all(np.isnan(diverged[k]) for k in ("spearman", "kendall_tau", "top1_accuracy", "loss"))
    with pytest.raises(DataError, match="not a ranking loss"):
        ranking_metrics(rows, rewards, "mse")
