"""Where a SmolLM2-135M training step spends its time: XLA op time per step from a jax.profiler trace.

    .venv/bin/python benchmarks/profile_step.py [--shape 4x128] [--steps 5] [--top 25]
    .venv/bin/python benchmarks/profile_step.py --workload long [--layout packed]
        [--matmul-dtype bfloat16]    # issue #7's model on a compare.py workload instead

Builds issue #4's trainer (SmolLM2-135M-Instruct, batch 8, shared_prompt rows of 128 or 192
tokens, bf16 projection matmuls, host memory retained), draws batches until one of the requested
rows x tokens shape, compiles the train step on it, times `--steps` steps, then traces two more
and sums each XLA op's duration over XLA's worker threads. Prints the step times, the summed
thread-seconds per step of the leaf ops, and the ops grouped by name with the ".N" suffix removed
(ynn_fusion = the YNNPACK matmuls; add_select_fusion = the optimizer update). Thread-seconds are
steadier than wall time on a shared machine: compare them between two versions of the code.

`--workload short|long|shared` profiles issue #7's side-by-side model (`compare/bench_common.py`)
on that workload's rows instead (built by `compare/compare.py` under .bench-cache/compare, which
must have run once), at the batch shape its first 13 batches have most often (`--shape` ignored).
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile
import time

import rewardax as rx
from rewardax import hostmem

# The ThunkExecutor events enclose the ops they run; only the ops themselves are summed.
_ENCLOSING = ("ThunkExecutor::Execute", "SlinkyThreadPool::Await")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4x128", help="rows x tokens of the traced batch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps before the trace")
    parser.add_argument("--top", type=int, default=25, help="op groups to print")
    parser.add_argument("--workload", choices=["short", "long", "shared"], default=None)
    parser.add_argument("--layout", default="packed", help="with --workload: data.layout")
    parser.add_argument("--matmul-dtype", default="bfloat16", help="with --workload")
    args = parser.parse_args()
    want = tuple(int(x) for x in args.shape.split("x"))

    hostmem.retain_freed_memory()  # before JAX starts its CPU backend
    import jax

    from recipe_step import recipe_step

    with tempfile.TemporaryDirectory() as tmp:
        if args.workload:
            train_step, arrays, batch = compare_step(tmp, args)
            want = tuple(batch["input_ids"].shape)
        else:
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


def compare_step(save_directory: str, args: argparse.Namespace):
    """(jitted train step, state arrays, device batch) of issue #7's model on a compare workload."""
    import itertools
    import sys
    from pathlib import Path

    from flax import nnx
    from transformers import PreTrainedTokenizerFast

    from rewardax import distributed
    from rewardax.sharding import global_batch
    from rewardax.trainer import _model_inputs

    compare = Path(__file__).resolve().parent / "compare"
    sys.path.insert(0, str(compare))
    from bench_common import BATCH_PAIRS, LEARNING_RATE, MODEL, SEED, read_workload

    cache = compare.parent.parent / ".bench-cache" / "compare"
    n_batches = 13
    meta, rows = read_workload(str(cache / args.workload), n_batches * BATCH_PAIRS)
    tok = PreTrainedTokenizerFast.from_pretrained(str(cache / "tokenizer"))
    config = rx.ModelConfig(**MODEL, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = rx.RewardModel(
        config,
        dtype="float32",
        param_dtype="float32",
        matmul_dtype=args.matmul_dtype,
        rngs=nnx.Rngs(SEED),
    )
    trainer = rx.RewardTrainer(
        rx.RewardConfig(
            per_device_train_batch_size=BATCH_PAIRS,
            learning_rate=LEARNING_RATE,
            max_sequence_length=meta["max_length"],
            max_training_steps=n_batches,
            seed=SEED,
            progress_bar=False,
            save_directory=save_directory,
            resume="off",
            layout=args.layout,
        ),
        tok,
        model=model,
        train_dataset=rows,
    )
    fns = trainer.configure_functions()
    loader = trainer.train_loader
    batches = list(itertools.islice(distributed.lockstep(loader, loader.pad_id), n_batches))
    shapes = collections.Counter(b["input_ids"].shape for b in batches)
    print(f"{args.workload} batch shapes (rows x tokens): {dict(shapes)}")
    shape = shapes.most_common(1)[0][0]
    host_batch = next(b for b in batches if b["input_ids"].shape == shape)
    return (
        fns.train_step,
        trainer.state.arrays(),
        global_batch(_model_inputs(host_batch), trainer.mesh),
    )


if __name__ == "__main__":
    main()
