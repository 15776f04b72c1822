"""`rewardax plan`'s HBM per chip against what the v5e chip's own compiler reported (issue 29).

    PYTHONPATH=.venv/libtpu python benchmarks/plan_vs_chip.py [--results FILE.jsonl] [--out FILE.md]

Reads the train-step rows that ran on the chip (`benchmarks/tpu_bench.py` writes the compiled
program's `memory_analysis()` there as `hbm_gib`), plans each one's configuration for `v5e:1x1`
on this machine with libtpu (no TPU), and prints both figures and their ratio as a Markdown table.
The configurations: the model shapes of `configs/shapes/`, bf16 compute, the row's parameter
dtype, remat and pairs, padded rows of exactly T tokens, AdamW, the kernels `auto` picks on a TPU
(the tuned splash tiles of the run that wrote the file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rewardax.config import RewardConfig
from rewardax.plan import GIB, plan

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = ROOT / "benchmarks/results/tpu_v5e_2026-12-05_tune.jsonl"


def settings(row: dict) -> dict:
    return {
        "model": {
            "path": str(ROOT / "configs/shapes" / row["shape"]),
            "dtype": "bfloat16",
            "param_dtype": row["param_dtype"],
            "remat_policy": row["remat"],
            "kernels": "auto",
        },
        "data": {"max_sequence_length": row["T"]},
        "train": {"per_device_train_batch_size": row["pairs"], "max_training_steps": 1000},
        "mesh": {"dp": 1, "fsdp": -1, "tp": 1},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind") == "train_step" and r.get("hbm_gib")]
    lines = [
        "| shape | T | pairs | remat | params | chip GiB | plan GiB | plan / chip | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        result = plan(RewardConfig.from_dict(settings(row)), "v5e:1x1", suggest=False)
        planned = result.job.memory.hbm / GIB
        lines.append(
            f"| {row['shape']} | {row['T']} | {row['pairs']} | {row['remat']} | "
            f"{row['param_dtype']} | {row['hbm_gib']:.3f} | {planned:.3f} | "
            f"{planned / row['hbm_gib']:.4f} | {result.job.compile_s:.0f} |"
        )
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
