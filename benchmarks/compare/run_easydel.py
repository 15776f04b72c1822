"""EasyDeL 0.3.0 on one workload of the side-by-side benchmark (its own venv: .bench-venvs/easydel).

The same Llama shape as every framework (random init, float32, CPU JAX), EasyDeL's RewardTrainer
with its own data path: every row padded to `max_length`, chosen and rejected in two forward
passes. Rows are given as {chosen: prompt + chosen, rejected: prompt + rejected}: with an explicit
`prompt` column EasyDeL 0.3.0's RewardPreprocessTransform drops the prompt from the text it
tokenizes (it prefixes the prompt only when it extracted it itself), which would make its
sequences shorter than every other framework's. Settings changed from EasyDeL's defaults: no W&B,
no saving, `performance_mode=True` and no metric reports (its fastest loop). `--option key=value`
overrides any ed.RewardConfig field (strings parsed as JSON where they parse).

A step's time is the wall time between consecutive `on_step_end` hooks (the first from the start
of `train()`): next batch + jitted step (EasyDeL blocks until it is done) + its per-step hooks.
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
    StepClock,
    read_workload,
    run_guarded,
    runner_args,
)


def main() -> None:
    args = runner_args(__doc__)
    result = Result(framework="easydel", workload=Path(args.workload_dir).name, warmup=args.warmup)
    run_guarded(result, args.out, lambda r: train(r, args))


def _parse(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def train(result: Result, args) -> None:
    import datasets
    import easydel as ed
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from transformers import PreTrainedTokenizerFast

    result.version = ed.__version__
    n_steps = args.warmup + args.steps
    meta, rows = read_workload(args.workload_dir, n_steps * BATCH_PAIRS)
    tok = PreTrainedTokenizerFast.from_pretrained(args.tokenizer_dir)
    config = ed.LlamaConfig(
        **{k: v for k, v in MODEL.items() if k != "architecture"},
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model = ed.LlamaForSequenceClassification(
        config=config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(SEED)
    )
    clock, tokens = StepClock(), {"real": 0, "computed": 0}
    counter = CompileCounter()
    step_ends: list[float] = []

    class TimedRewardTrainer(ed.RewardTrainer):
        def _execute_train_step(self, state, batch):
            for side in ("chosen", "rejected"):
                mask = np.asarray(batch[f"attention_mask_{side}"])
                tokens["real"] += int(mask.sum())
                tokens["computed"] += mask.size
            return super()._execute_train_step(state, batch)

        def on_step_end(self, state, metrics, step):
            out = super().on_step_end(state=state, metrics=metrics, step=step)
            clock.step_done()
            step_ends.append(time.time())
            return out

    texts = [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows
    ]
    with tempfile.TemporaryDirectory(prefix="easydel-compare-") as out_dir:
        settings = {
            "total_batch_size": BATCH_PAIRS,
            "learning_rate": LEARNING_RATE,
            "max_length": meta["max_length"],
            "max_training_steps": n_steps,
            "num_train_epochs": 1,
            "save_directory": out_dir,
            "save_steps": None,
            "do_last_save": False,
            "use_wandb": False,
            "report_metrics": False,
            "performance_mode": True,
            "progress_bar_type": "json",
            "shuffle_seed_train": SEED,
        }
        settings.update({k: _parse(v) for k, v in (o.split("=", 1) for o in args.option)})
        trainer = TimedRewardTrainer(
            arguments=ed.RewardConfig(**settings),
            processing_class=tok,
            model=model,
            train_dataset=datasets.Dataset.from_list(texts),
        )
        clock.start()
        start = time.time()
        trainer.train()
    result.step_times = clock.times
    result.compile_steps, result.compile_seconds = counter.steps_with_compiles(step_ends, start)
    result.real_tokens, result.computed_tokens = tokens["real"], tokens["computed"]
    train_compiles = len([t for t in counter.times if t > start])
    result.compiles = train_compiles
    result.compile_detail = f"{train_compiles} XLA compiles in train() (jax {jax.__version__})"
    result.notes.append("rows given as prompt+response text (see the module docstring)")


if __name__ == "__main__":
    main()
