"""Issue #4's quality recipe: SmolLM2-135M-Instruct on 640 VADER movie-sentence pairs.

    .venv/bin/python benchmarks/bench_quality.py [--steps 80] [--layout padded] [--epochs 1]

Batch 8, 80 steps (one epoch), AdamW lr 2e-5, 5 warmup steps, linear decay; held-out accuracy on
the 256 bundled held-out pairs before and after. `train_s` is the wall time of
`RewardTrainer.train()` alone (training loop with every compilation, the final checkpoint and the
Hugging Face export; no evaluation inside it), the figure to set beside TRL's `train_runtime`
(`benchmarks/compare/trl_quality.py`, which times TRL's training loop the same way). The two
evaluations are timed apart (`eval_before_s`, `eval_after_s`). `train_compile_s` is the part
of `train_s` spent making programs, from JAX's duration events: tracing the Python functions,
lowering them to MLIR, and XLA compiling them (each on a single thread before the program's first
step; `xla_programs_over_1s` lists the big ones, the train step's shapes).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib import resources

import jax
import jax.monitoring

import rewardax as rx
from rewardax import hostmem
from rewardax.models import smollm2_gguf_path

# The events JAX records around the stages of making a program (jax/_src/dispatch.py).
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "xla",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: one pass per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--matmul-dtype", default=None, help="model.matmul_dtype (default: --dtype)"
    )
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--layout", default="padded", choices=["padded", "packed", "shared_prompt"])
    parser.add_argument(
        "--bucket-lengths", default="", help="comma-separated row lengths (default: the ladder)"
    )
    parser.add_argument("--train", default=None, help="default: the bundled VADER train split")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seeds the score head and the shuffling, as train.seed does in `rewardax train` "
        "(default: head seed 0, shuffle seed 42, the figures in benchmarks/README.md)",
    )
    parser.add_argument(
        "--no-final-checkpoint",
        action="store_true",
        help="checkpoint.save_final=false: end with the export only, as TRL's save_strategy='no'",
    )
    args = parser.parse_args()

    assets = resources.files("rewardax") / "assets"
    train_path = args.train or str(assets / "vader_movie_pairs.train.jsonl")
    heldout = {"heldout": str(assets / "vader_movie_pairs.heldout.jsonl")}
    # Before the model load starts JAX's CPU backend; `rewardax train` does the same.
    hostmem.retain_freed_memory()
    t0 = time.perf_counter()
    tokenizer = rx.load_tokenizer(smollm2_gguf_path())
    head_seed = 0 if args.seed is None else args.seed
    model = rx.AutoRewardModel.from_pretrained(
        smollm2_gguf_path(), dtype=args.dtype, matmul_dtype=args.matmul_dtype, seed=head_seed
    )
    load_s = time.perf_counter() - t0
    buckets = [int(b) for b in args.bucket_lengths.split(",") if b]
    with tempfile.TemporaryDirectory() as tmp:
        config = rx.RewardConfig(
            per_device_train_batch_size=8,
            per_device_eval_batch_size=32,
            learning_rate=args.learning_rate,
            warmup_steps=5,
            schedule="linear",
            num_train_epochs=args.epochs,
            max_training_steps=args.steps,
            max_sequence_length=args.max_length,
            layout=args.layout,
            bucket_lengths=buckets,
            save_directory=tmp,
            save_final=not args.no_final_checkpoint,
            logging_steps=10,
            progress_bar=False,
            seed=42 if args.seed is None else args.seed,
        )
        # No eval set inside the trainer: train() then times training alone.
        trainer = rx.RewardTrainer(config, tokenizer, model=model, train_dataset=train_path)
        t1 = time.perf_counter()
        before = trainer.evaluate(heldout)["heldout"]
        eval_before_s = time.perf_counter() - t1
        compile_s: dict[str, list[float]] = {stage: [] for stage in COMPILE_EVENTS.values()}

        def on_duration(event: str, duration: float, **_: object) -> None:
            if event in COMPILE_EVENTS:
                compile_s[COMPILE_EVENTS[event]].append(duration)

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        t2 = time.perf_counter()
        result = trainer.train()
        train_s = time.perf_counter() - t2
        jax.monitoring.unregister_event_duration_listener(on_duration)
        t3 = time.perf_counter()
        after = trainer.evaluate(heldout)["heldout"]
        eval_after_s = time.perf_counter() - t3
        compiles = trainer.configure_functions().train_step._cache_size()
    train = result.metrics["train"]
    print(
        json.dumps(
            {
                "devices": str(jax.devices()),
                "host_memory": hostmem.status(),
                "dtype": args.dtype,
                "matmul_dtype": args.matmul_dtype,
                "layout": args.layout,
                "final_checkpoint": not args.no_final_checkpoint,
                "bucket_lengths": buckets or "ladder",
                "learning_rate": args.learning_rate,
                "seed": args.seed,
                "train_file": train_path,
                "steps": result.metrics["step"],
                "heldout_accuracy_before": before["accuracy"],
                "heldout_accuracy_after": after["accuracy"],
                "heldout_loss_after": round(after["loss"], 4),
                "train_s": round(train_s, 1),
                "train_timing": result.metrics["timing"],
                "train_compile_s": {
                    **{stage: round(sum(d), 2) for stage, d in compile_s.items()},
                    "xla_programs_over_1s": [round(d, 2) for d in compile_s["xla"] if d > 1],
                },
                "train_step_programs_compiled": compiles,
                "eval_before_s": round(eval_before_s, 1),
                "eval_after_s": round(eval_after_s, 1),
                "load_s": round(load_s, 1),
                "train_pairs_per_second_last_window": round(train["pairs_per_second"], 3),
                "padding_efficiency": round(train["padding_efficiency"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
