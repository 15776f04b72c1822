"""XLA:CPU flags: SmolLM2-135M training-step time (and first-step compile time) per flag setting.

    .venv/bin/python benchmarks/bench_xla_flags.py [--rounds 3] [--steps 5]
        [--setting NAME=FLAGS ...]

Each setting runs in its own subprocess with XLA_FLAGS=FLAGS (flags are read once, when JAX's CPU
backend starts), the settings in turn `--rounds` times so that machine noise hits all alike. The
subprocess is `bench_host_memory.py`'s: issue #4's trainer (SmolLM2-135M-Instruct, batch 8,
shared_prompt rows, bf16 matmuls, host memory retained), one batch of 4 rows x 128 tokens,
compiled, then `--steps` timed steps on it. Default settings: none (XLA's defaults) and
`--xla_cpu_prefer_vector_width=512` (an ad hoc run on 2026-12-04's AMD EPYC had it ~5% faster;
this script measured it 6% slower on 2026-12-04's second EPYC, so rewardax does not set it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HOST_MEMORY_BENCH = Path(__file__).with_name("bench_host_memory.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="repeatable; default: default= and wide=--xla_cpu_prefer_vector_width=512",
    )
    args = parser.parse_args()
    settings = dict(s.split("=", 1) for s in args.setting) or {
        "default": "",
        "wide": "--xla_cpu_prefer_vector_width=512",
    }
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, flags in settings.items():
            env = {**os.environ, "XLA_FLAGS": flags}
            out = subprocess.run(
                [sys.executable, str(HOST_MEMORY_BENCH), "--child", "--steps", str(args.steps)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'setting':10} {'median s':>9} {'first s':>8}  steps (s, sorted)  flags")
    medians = {}
    for name, runs in results.items():
        times = sorted(t for run in runs for t in run["times"])
        medians[name] = statistics.median(times)
        first = statistics.median(r["first_step_s"] for r in runs)
        print(
            f"{name:10} {medians[name]:9.3f} {first:8.1f}  "
            + " ".join(f"{t:.2f}" for t in times)
            + f"  {settings[name]!r}"
        )
    base = next(iter(medians.values()))
    for name, median in medians.items():
        print(f"median {name} / {next(iter(medians))}: {median / base:.3f}")


if __name__ == "__main__":
    main()
