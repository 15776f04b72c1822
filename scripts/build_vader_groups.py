"""Builds 4-response rankings and score rows from the shipped VADER pair files.

    python scripts/build_vader_groups.py OUT_DIR [--assets DIR]

Reads only the pair files that ship in the package (`src/rewardax/assets/vader_movie_pairs.*`),
whose `score_chosen` / `score_rejected` are the sentences' mean human ratings (Hutto & Gilbert,
ICWSM 2014; built from ../shared/data/vader/ by scripts/build_vader_pairs.py), so it needs neither
../shared nor a network. `benchmarks/bench_modes.py` calls `build()` into a temporary folder; the
outputs are not shipped.

The same training sentences, the same human ratings, only packaged differently:
- `groups.train.jsonl`: the default job's training pairs (train, then train_extra: 960 pairs)
  taken two at a time in file order; each pair of pairs (2 sentences rated >= +1.5, 2 rated
  <= -1.5) is one row ranking its 4 sentences by mean rating (rank 1 = highest; equal ratings
  share a rank). 480 rows, every training sentence once.
- `scores.train.jsonl`: each training sentence once as a score row, `score` = its mean rating
  (1,920 rows, in file order: chosen then rejected of each pair).
- `scores.heldout.jsonl`: the 512 sentences of the 256 held-out pairs as score rows (never seen in
  training); `scores.heldout_positive.jsonl` / `scores.heldout_negative.jsonl` hold the chosen
  (>= +1.5) and rejected (<= -1.5) halves, where a pair's label says nothing about the order.

What each file tells the model beyond the pairs' labels: a ranking also orders the two positive
and the two negative sentences of its row, a score row gives the rating itself.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

TRAIN_SPLITS = ("train", "train_extra")  # the default job's training files, in its order
GROUP_SIZE = 4


def read_pairs(assets: Path, split: str) -> list[dict]:
    with open(assets / f"vader_movie_pairs.{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sentences(pairs: list[dict]) -> list[tuple[str, str, float]]:
    """(prompt, sentence, mean rating) of each pair's chosen then rejected sentence."""
    out = []
    for p in pairs:
        out.append((p["prompt"], p["chosen"], p["score_chosen"]))
        out.append((p["prompt"], p["rejected"], p["score_rejected"]))
    return out


def ranking_row(group: list[tuple[str, str, float]]) -> dict:
    """One row ranking the group's sentences by rating: rank 1 is the highest; ties share a rank."""
    ratings = sorted({rating for _, _, rating in group}, reverse=True)
    return {
        "prompt": group[0][0],
        "responses": [text for _, text, _ in group],
        "ranks": [ratings.index(rating) + 1 for _, _, rating in group],
    }


def score_rows(items: list[tuple[str, str, float]]) -> list[dict]:
    return [{"prompt": p, "response": text, "score": rating} for p, text, rating in items]


def build(out_dir: str | Path, assets: str | Path | None = None) -> dict[str, Path]:
    """Writes the five files into `out_dir`; returns their paths by name."""
    assets = Path(assets) if assets else Path(str(resources.files("rewardax") / "assets"))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train = sentences([p for split in TRAIN_SPLITS for p in read_pairs(assets, split)])
    heldout = sentences(read_pairs(assets, "heldout"))
    files = {
        "groups.train": [
            ranking_row(train[i : i + GROUP_SIZE]) for i in range(0, len(train), GROUP_SIZE)
        ],
        "scores.train": score_rows(train),
        "scores.heldout": score_rows(heldout),
        "scores.heldout_positive": score_rows(heldout[0::2]),
        "scores.heldout_negative": score_rows(heldout[1::2]),
    }
    paths = {}
    for name, rows in files.items():
        paths[name] = out_dir / f"{name}.jsonl"
        with open(paths[name], "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--assets", default=None, help="default: the installed package's assets")
    args = parser.parse_args()
    for path in build(args.out_dir, args.assets).values():
        with open(path, encoding="utf-8") as f:
            print(f"{path}: {sum(1 for _ in f)} rows")


if __name__ == "__main__":
    main()
