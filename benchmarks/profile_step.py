"""Where a SmolLM2-135M training step spends its time: XLA op time per step from a jax.profiler trace.

    .venv/bin/python benchmarks/profile_step.py [--shape 4x128] [--steps 5] [--top 25]

Builds issue #4's trainer (SmolLM2-135M-Instruct, batch 8, shared_prompt rows of 128 or 192
tokens, bf16 projection matmuls, host memory retained), draws batches until one of the requested
rows x tokens shape, compiles the train step on it, times `--steps` steps, then traces two more
and sums each XLA op's duration over XLA's worker threads. Prints the step times, the summed
thread-seconds per step of the leaf ops, and the ops grouped by name with the ".N" suffix removed
(ynn_fusion = the YNNPACK matmuls; add_select_fusion = the optimizer update). Thread-seconds are
steadier than wall time on a shared machine: compare them between two versions of the code.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile
import time

import rewardax as rx

# The ThunkExecutor events enclose the ops they run; only the ops themselves are summed.
_ENCLOSING = ("ThunkExecutor::Execute", "SlinkyThreadPool::Await")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4x128", help="rows x tokens of the traced batch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps before the trace")
    parser.add_argument("--top", type=int, default=25, help="op groups to print")
    args = parser.parse_args()
    want = tuple(int(x) for x in args.shape.split("x"))

    rx.retain_freed_memory()  # before JAX starts its CPU backend
    import jax

    from recipe_step import recipe_step

    with tempfile.TemporaryDirectory() as tmp:
        train_step, arrays, batch = recipe_step(tmp, want)
        arrays, metrics = train_step(arrays, batch)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            arrays, metrics = train_step(arrays, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        print(f"shape {want}: step seconds (sorted) " + " ".join(f"{t:.3f}" for t in sorted(times)))

        traced = 2
        trace_dir = tempfile.mkdtemp(dir=tmp)
        jax.profiler.start_trace(trace_dir)
        for _ in range(traced):
            arrays, metrics = train_step(arrays, batch)
            jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)

    per_op: collections.Counter[str] = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA's CPU worker threads
                continue
            for event in line.events:
                if not event.name.startswith(_ENCLOSING):
                    per_op[event.name] += event.duration_ns / 1e9 / traced
    groups: collections.Counter[str] = collections.Counter()
    for name, seconds in per_op.items():
        groups[re.sub(r"\.\d+$", "", name)] += seconds
    print(f"XLA op thread-seconds per step: {sum(per_op.values()):.3f}")
    for name, seconds in groups.most_common(args.top):
        print(f"{seconds:8.3f}  {name}")


if __name__ == "__main__":
    main()
