"""rewardax on one workload of the side-by-side benchmark (this repository's .venv).

Trains through the public API (`RewardTrainer.train()`), so whatever the library does by default
(length bucketing, and packing / shared-prompt layouts where they are the default) is what is
measured. `--option key=value` passes extra RewardConfig settings (e.g. `--option length_group_window=64`;
strings are parsed by the field's type).

Step times come from the trainer's own `metrics.jsonl` with `logging_steps=1`: each line's
`pairs_per_second` is that step's pairs over the wall time from the previous step's end (next
batch + jitted step + device_get of its metrics).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench_common import (
    BATCH_PAIRS,
    LEARNING_RATE,
    MODEL,
    SEED,
    CompileCounter,
    Result,
    read_workload,
    run_guarded,
    runner_args,
)

# RewardModel arguments that `--option` may set (the rest go to RewardConfig).
MODEL_PRECISION = ("dtype", "param_dtype", "matmul_dtype", "remat_policy")


def main() -> None:
    args = runner_args(__doc__)
    result = Result(framework="rewardax", workload=Path(args.workload_dir).name, warmup=args.warmup)
    run_guarded(result, args.out, lambda r: train(r, args))


def train(result: Result, args) -> None:
    from flax import nnx
    from transformers import PreTrainedTokenizerFast

    import rewardax as rx
    from rewardax import hostmem

    hostmem.retain_freed_memory()  # before the model below starts JAX's CPU backend
    result.version = rx.__version__
    n_steps = args.warmup + args.steps
    meta, rows = read_workload(args.workload_dir, n_steps * BATCH_PAIRS)
    tok = PreTrainedTokenizerFast.from_pretrained(args.tokenizer_dir)
    model_cfg = rx.ModelConfig(
        **MODEL,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    overrides = dict(option.split("=", 1) for option in args.option)
    # The model is built here (random init), so its precision settings are taken out of the
    # options and given to it: `--option matmul_dtype=bfloat16` runs the projection matmuls in
    # bf16 with float32 weights, activations, norms, softmax and loss.
    precision = {
        key: overrides.pop(name)
        for name in list(overrides)
        if (key := name.rsplit(".", 1)[-1]) in MODEL_PRECISION
    }
    model = rx.RewardModel(
        model_cfg,
        **{"dtype": "float32", "param_dtype": "float32", **precision},
        rngs=nnx.Rngs(SEED),
    )
    result.notes.extend(f"{key}={value}" for key, value in precision.items())
    with tempfile.TemporaryDirectory(prefix="rewardax-compare-") as run_root:
        flat = {
            "per_device_train_batch_size": BATCH_PAIRS,
            "learning_rate": LEARNING_RATE,
            "max_sequence_length": meta["max_length"],
            "max_training_steps": n_steps,
            "seed": SEED,
            "logging_steps": 1,
            "progress_bar": False,
            "save_directory": run_root,
            "resume": "off",
        }
        # Field names are unique across RewardConfig's sections: "data.x=1" and "x=1" are the same.
        flat.update({key.rsplit(".", 1)[-1]: value for key, value in overrides.items()})
        config = rx.RewardConfig(**flat)
        counter = CompileCounter()
        trainer = rx.RewardTrainer(
            arguments=config, processing_class=tok, model=model, train_dataset=rows
        )
        start = time.time()
        out = trainer.train()
        train_rows = [
            json.loads(line)
            for line in (out.run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["split"] == "train"
        ]
    result.step_times = [r["num_pairs"] / r["pairs_per_second"] for r in train_rows]
    # metrics.jsonl's "time" is wall time when the step was logged (after its metrics arrived).
    result.compile_steps, result.compile_seconds = counter.steps_with_compiles(
        [r["time"] for r in train_rows], start
    )
    stats = trainer.train_loader.stats
    result.real_tokens, result.computed_tokens = stats.real_tokens, stats.computed_tokens
    programs = trainer.configure_functions().train_step._cache_size()
    result.compiles = programs
    result.compile_detail = (
        f"{programs} train-step programs (jit cache = distinct batch shapes); "
        f"{len([t for t in counter.times if t > start])} XLA compiles in train() in all"
    )
    if stats.dropped:
        result.notes.append(f"loader dropped {stats.dropped}")
    if stats.truncated:
        result.notes.append(f"loader truncated {stats.truncated} pairs")


if __name__ == "__main__":
    main()
