"""Train-step throughput of the three batch layouts (padded, packed, shared_prompt), issue #7.

Model: the tiny Llama of the side-by-side benchmark (hidden 256, 4 layers, 4 heads, MLP 704,
SmolLM2's tokenizer and vocab 49,152, float32), batch 8 pairs, AdamW lr 1e-5, one jitted train step.
Workloads: `short` (VADER sentence pairs, max length 128) and `shared` (a ~1k-token review shared
as the prompt of two one-sentence answers, max length 2048), read from the benchmark cache that
`benchmarks/compare/workloads.py` builds (`.bench-cache/compare/<name>/rows.jsonl`); without it,
`short` falls back to the packaged VADER pairs and `shared` is skipped.

Each layout sees the same rows. Every batch is run once first (this compiles each distinct shape),
then the same batches are timed again: pairs/s = real pairs / time of the second pass.

Run: `.venv/bin/python benchmarks/bench_layouts.py [--batches 16] [--workloads short shared]`
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import rewardax as rx  # noqa: E402
from data_fixtures import smollm2_tokenizer  # noqa: E402
from rewardax.data import DataConfig, PreferenceLoader, token_counts  # noqa: E402
from rewardax.state import RewardState  # noqa: E402
from rewardax.steps import make_train_step  # noqa: E402
from rewardax.trainer import _model_inputs  # noqa: E402

CACHE = ROOT / ".bench-cache" / "compare"
MAX_LENGTH = {"short": 128, "shared": 2048}


def workload_rows(name: str) -> list[dict] | None:
    path = CACHE / name / "rows.jsonl"
    if not path.exists():
        if name != "short":
            return None
        path = Path(str(resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl"))
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def measure(rows, tokenizer, layout: str, max_length: int, batches: int) -> dict:
    config = DataConfig(max_sequence_length=max_length, layout=layout, prefetch=0)
    loader = PreferenceLoader(rows, tokenizer, config, batch_size=8, seed=0, num_epochs=1)
    host = []
    for batch in loader:
        host.append(_model_inputs(batch))
        if len(host) == batches:
            break
    model_config = rx.ModelConfig(
        architecture="llama",
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    optimizer = optax.adamw(1e-5)
    state = RewardState.create(rx.RewardModel(model_config, rngs=nnx.Rngs(0)), optimizer)
    step = jax.jit(
        make_train_step(state.graphdef, optimizer, optax.constant_schedule(1e-5)),
        donate_argnums=(0,),
    )
    arrays = state.arrays()
    device_batches = [jax.device_put(b) for b in host]
    start = time.perf_counter()
    for b in device_batches:  # compiles every distinct shape
        arrays, metrics = step(arrays, b)
    jax.block_until_ready(metrics)
    warm_s = time.perf_counter() - start
    start = time.perf_counter()
    for b in device_batches:
        arrays, metrics = step(arrays, b)
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - start
    pairs = sum(float(np.sum(b["pair_mask"])) for b in host)
    real = sum(token_counts(b)[0] for b in host)
    computed = sum(token_counts(b)[1] for b in host)
    return {
        "layout": layout,
        "pairs_per_s": round(pairs / elapsed, 2),
        "step_ms": round(1000 * elapsed / len(host), 1),
        "padding_efficiency": round(real / computed, 3),
        "computed_tokens_per_pair": round(computed / pairs, 1),
        "shapes": len({b["input_ids"].shape for b in host}),
        "first_pass_s": round(warm_s, 1),
        "batches": len(host),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--workloads", nargs="+", default=["short", "shared"])
    parser.add_argument("--layouts", nargs="+", default=["padded", "packed", "shared_prompt"])
    args = parser.parse_args()
    tokenizer = smollm2_tokenizer()
    results = []
    for name in args.workloads:
        rows = workload_rows(name)
        if rows is None:
            print(f"skip {name}: build it with benchmarks/compare/workloads.py", flush=True)
            continue
        for layout in args.layouts:
            result = {
                "workload": name,
                **measure(rows, tokenizer, layout, MAX_LENGTH[name], args.batches),
            }
            print(json.dumps(result), flush=True)
            results.append(result)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
