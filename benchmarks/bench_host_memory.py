"""rewardax.hostmem.retain_freed_memory(): SmolLM2-135M training-step time with and without it.

    .venv/bin/python benchmarks/bench_host_memory.py [--rounds 2] [--steps 5]

Each setting runs in its own subprocess (the malloc settings are process-wide and only apply
before JAX's CPU backend starts), `--rounds` times in turn so that machine noise hits both alike.
A subprocess builds issue #4's trainer (SmolLM2-135M-Instruct, batch 8, shared_prompt rows of 128
or 192 tokens, bf16 matmuls), draws batches until one of 4 rows x 128 tokens (the most frequent
shape of that recipe), compiles the train step on it and then times `--steps` steps on the same
batch. Prints per setting: the sorted step times, the median, minor page faults, and the kernel
(sys) and user CPU seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def child(steps: int) -> dict:
    from rewardax import hostmem

    applied = hostmem.retain_freed_memory()
    import jax

    from recipe_step import recipe_step

    with tempfile.TemporaryDirectory() as tmp:
        train_step, arrays, batch = recipe_step(tmp, (4, 128))
        start = time.perf_counter()
        arrays, metrics = train_step(arrays, batch)
        jax.block_until_ready(metrics)
        first_s = time.perf_counter() - start
        times = []
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(steps):
            start = time.perf_counter()
            arrays, metrics = train_step(arrays, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "applied": applied,
        "status": hostmem.status(),
        "first_step_s": first_s,  # compilation + one step
        "times": times,
        "minflt_per_step": (after.ru_minflt - before.ru_minflt) / steps,
        "sys_s_per_step": (after.ru_stime - before.ru_stime) / steps,
        "user_s_per_step": (after.ru_utime - before.ru_utime) / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.steps)))
        return
    results: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for name, switch in (("off", "0"), ("on", "1")):
            env = {**os.environ, "REWARDAX_RETAIN_HOST_MEMORY": switch}
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--steps", str(args.steps)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"{'setting':8} {'applied':8} {'median s':>9} {'faults/step':>12} {'sys s':>6} {'user s':>7}  steps (s)"
    )
    medians = {}
    for name, runs in results.items():
        times = sorted(t for run in runs for t in run["times"])
        medians[name] = statistics.median(times)
        print(
            f"{name:8} {runs[0]['applied']!s:8} {medians[name]:9.2f} "
            f"{statistics.mean(r['minflt_per_step'] for r in runs):12.0f} "
            f"{statistics.mean(r['sys_s_per_step'] for r in runs):6.2f} "
            f"{statistics.mean(r['user_s_per_step'] for r in runs):7.2f}  "
            + " ".join(f"{t:.2f}" for t in times)
        )
    print(f"median on / off: {medians['on'] / medians['off']:.3f}")


if __name__ == "__main__":
    main()
