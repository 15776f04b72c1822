"""Tokenizing ranked rows (4 responses each): `GroupProcessor.process_many` on loader-sized
chunks against one tokenizer call per response.

Run from the repository root:
  .venv/bin/python benchmarks/bench_group_tokenize.py [--rows 4000] [--data ../shared/data]
Prints one JSON line per (workload, path) and a summary JSON line last. Workloads: `text` (a
string prompt and 4 VADER sentences) and `chat` (the same as a user message and 4 assistant
replies, through SmolLM2's chat template). Paths: `chunks` calls `process_many` on chunks of 128
rows, as the loader does (`loader._CHUNK_ROWS`); `per_response` calls `ResponseEncoder.fit` once
per response, which is what `process_many` did before it tokenized a chunk at once. Each figure
is the best of `--repeats` passes over all rows (the paths take turns; the machine is shared), as
rows per wall second and rows per CPU second of the process (less swayed by other processes).
Run it with PYTHONPATH pointing at an older `src` to time that code's `process_many`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from compare.workloads import rated_sentences  # benchmarks/ is the script's directory
from rewardax.data import DataConfig
from rewardax.data.groups import GroupProcessor, response_rows
from rewardax.models import load_tokenizer, smollm2_gguf_path

CHUNK_ROWS = 128
PROMPT = "Write one sentence about a film you saw.\n"


def ranked_rows(root: Path, n: int, chat: bool) -> list[dict]:
    """n rows of 4 VADER movie sentences ranked by their mean human rating (as `ResponseGroups`
    hands rows to `GroupProcessor`: `responses` and `targets`)."""
    vader = root / "vader" / "movieReviewSnippets_GroundTruth.txt"
    rated = rated_sentences(vader.read_text(encoding="utf-8", errors="replace"))
    rows = []
    for i in range(n):
        picked = [rated[(4 * i + j) * 7 % len(rated)] for j in range(4)]
        ranks = np.argsort(np.argsort([-r for r, _ in picked])).tolist()
        texts = [t for _, t in picked]
        if chat:
            prompt = [{"role": "user", "content": PROMPT.strip()}]
            responses = [[{"role": "assistant", "content": t}] for t in texts]
        else:
            prompt, responses = PROMPT, texts
        rows.append({"prompt": prompt, "responses": responses, "targets": ranks})
    return rows


def chunks(processor: GroupProcessor, rows: list[dict]) -> None:
    for start in range(0, len(rows), CHUNK_ROWS):
        part = rows[start : start + CHUNK_ROWS]
        records = processor.process_many(part, range(start, start + len(part)), str)
        assert not any("dropped" in r for r in records)


def per_response(processor: GroupProcessor, rows: list[dict]) -> None:
    for row in rows:
        for response in response_rows(row):
            processor.encoder.fit(response)


PATHS = {"per_response": per_response, "chunks": chunks}


def best_times(rows: list[dict], processor: GroupProcessor, repeats: int) -> dict[str, tuple]:
    """Per path, the best wall and CPU (all threads of this process) seconds of `repeats` passes;
    the paths take turns, so a busy spell of the shared machine does not fall on one alone."""
    best = {name: (math.inf, math.inf) for name in PATHS}
    for _ in range(repeats):
        for name, run in PATHS.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run(processor, rows)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args()

    tokenizer = load_tokenizer(smollm2_gguf_path())
    config = DataConfig(max_sequence_length=args.max_length)
    processor = GroupProcessor(tokenizer, config, "ranks")
    summary = {}
    for workload in ("text", "chat"):
        rows = ranked_rows(args.data, args.rows, chat=workload == "chat")
        chunks(processor, rows[:CHUNK_ROWS])  # warm-up: template compilation, caches
        best = best_times(rows, processor, args.repeats)
        for name, (wall, cpu) in best.items():
            line = {"workload": workload, "path": name, "rows": len(rows)}
            line.update(
                rows_per_s=round(len(rows) / wall, 1), rows_per_cpu_s=round(len(rows) / cpu, 1)
            )
            print(json.dumps(line), flush=True)
        summary[workload] = {
            "wall": round(best["per_response"][0] / best["chunks"][0], 2),
            "cpu": round(best["per_response"][1] / best["chunks"][1], 2),
        }
    print(json.dumps({"summary": "chunks / per_response rows/s", **summary}))


if __name__ == "__main__":
    main()
