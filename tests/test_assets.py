"""The bundled VADER pairs: sizes, rating thresholds, and no held-out sentence in any training file."""

from __future__ import annotations

import json

from rewardax import cli


def _pairs(name: str) -> list[dict]:
    with (cli.ASSETS / f"vader_movie_pairs.{name}.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_bundled_splits_have_their_sizes_and_thresholds():
    sizes = {name: len(_pairs(name)) for name in ("train", "heldout", "train_extra")}
    assert sizes == {"train": 640, "heldout": 256, "train_extra": 320}
    for name in sizes:
        for row in _pairs(name):
            assert row["score_chosen"] >= 1.5 and row["score_rejected"] <= -1.5, (name, row)


def test_no_sentence_is_shared_between_splits():
    sentences = {
        name: {s for row in _pairs(name) for s in (row["chosen"], row["rejected"])}
        for name in ("train", "heldout", "train_extra")
    }
    assert len(sentences["train"]) == 2 * 640  # every sentence is used once
    assert not sentences["heldout"] & sentences["train"]
    assert not sentences["heldout"] & sentences["train_extra"]
    assert not sentences["train"] & sentences["train_extra"]


def test_default_job_trains_on_both_training_files_and_holds_out_the_third():
    assert [p.rsplit("/", 1)[-1] for p in cli.DEFAULT_TRAIN] == [
        "vader_movie_pairs.train.jsonl",
        "vader_movie_pairs.train_extra.jsonl",
    ]
    assert cli.DEFAULT_EVAL["heldout"].endswith("vader_movie_pairs.heldout.jsonl")
