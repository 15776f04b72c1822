"""scripts/build_vader_groups.py: the data of benchmarks/bench_modes.py (the benchmark itself trains
SmolLM2 four times; its smoke run is `bench_modes.py --quick`)."""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from build_vader_groups import build

ASSETS = Path(str(resources.files("rewardax") / "assets"))


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def ratings(splits: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for split in splits:
        for p in read(ASSETS / f"vader_movie_pairs.{split}.jsonl"):
            out[p["chosen"]], out[p["rejected"]] = p["score_chosen"], p["score_rejected"]
    return out


def test_groups_and_scores_hold_the_training_pairs_sentences_once_each(tmp_path):
    files = build(tmp_path)
    train = ratings(("train", "train_extra"))
    groups = read(files["groups.train"])
    assert len(groups) == 480 and all(len(g["responses"]) == 4 for g in groups)
    grouped = [s for g in groups for s in g["responses"]]
    assert sorted(grouped) == sorted(train)  # every training sentence, once
    for g in groups:  # rank 1 is the highest rating; equal ratings share a rank
        by_rating = [train[s] for s in g["responses"]]
        for i in range(4):
            for j in range(4):
                assert (g["ranks"][i] < g["ranks"][j]) == (by_rating[i] > by_rating[j])
    scores = read(files["scores.train"])
    assert {r["response"]: r["score"] for r in scores} == train and len(scores) == len(train)


def test_heldout_score_rows_are_the_heldout_pairs_sentences_unseen_in_training(tmp_path):
    files = build(tmp_path)
    heldout, train = ratings(("heldout",)), ratings(("train", "train_extra"))
    rows = read(files["scores.heldout"])
    assert {r["response"]: r["score"] for r in rows} == heldout and len(rows) == 512
    assert not set(heldout) & set(train)
    assert all(r["score"] >= 1.5 for r in read(files["scores.heldout_positive"]))
    assert all(r["score"] <= -1.5 for r in read(files["scores.heldout_negative"]))


def test_the_build_is_deterministic(tmp_path):
    first, second = build(tmp_path / "a"), build(tmp_path / "b")
    assert all(first[name].read_bytes() == second[name].read_bytes() for name in first)
