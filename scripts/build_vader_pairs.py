"""Builds the default job's preference pairs from the VADER movie-sentence ratings.

    python scripts/build_vader_pairs.py ../shared/data/vader/movieReviewSnippets_GroundTruth.txt

Human ratings (Hutto & Gilbert, ICWSM 2014; about 20 raters a sentence, -4 to +4). Under the prompt
below a sentence rated >= +1.5 is preferred over one rated <= -1.5. Sentences are shuffled with a fixed
seed and paired once each; the first 640 pairs train (issue #4's recipe), the next 256 are held out,
and the 320 after those are `train_extra`: the default job trains on train + train_extra (960
distinct pairs; benchmarks/README.md has the held-out accuracy of each). The output is
deterministic, so rerunning this script reproduces the shipped files byte for byte.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

PROMPT = "Write one sentence about a film you saw.\n"
TRAIN_PAIRS, HELDOUT_PAIRS, EXTRA_PAIRS = 640, 256, 320
ASSETS = Path(__file__).resolve().parents[1] / "src" / "rewardax" / "assets"


def main(source: str) -> None:
    rows = []
    with open(source, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\r\n").split("\t")
            if len(parts) == 3:
                rows.append((float(parts[1]), parts[2].strip()))
    positive = sorted(r for r in rows if r[0] >= 1.5)
    negative = sorted(r for r in rows if r[0] <= -1.5)
    rng = random.Random(0)
    rng.shuffle(positive)
    rng.shuffle(negative)
    pairs = [
        {
            "prompt": PROMPT,
            "chosen": chosen,
            "rejected": rejected,
            "score_chosen": round(sc, 4),
            "score_rejected": round(sr, 4),
        }
        for (sc, chosen), (sr, rejected) in zip(positive, negative, strict=False)
    ]
    splits, start = {}, 0
    for name, size in (
        ("train", TRAIN_PAIRS),
        ("heldout", HELDOUT_PAIRS),
        ("train_extra", EXTRA_PAIRS),
    ):
        splits[name], start = pairs[start : start + size], start + size
    for name, split in splits.items():
        path = ASSETS / f"vader_movie_pairs.{name}.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            for pair in split:
                out.write(json.dumps(pair, ensure_ascii=False) + "\n")
        print(f"{path}: {len(split)} pairs")


if __name__ == "__main__":
    main(sys.argv[1])
