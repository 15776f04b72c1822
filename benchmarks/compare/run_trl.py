"""TRL 1.16.0 on one workload of the side-by-side benchmark (its own venv: .bench-venvs/trl).

The same Llama shape as every framework (random init, float32, CPU), TRL's RewardTrainer with its
own data path (prompt + response concatenated, EOS appended, dynamic padding to the batch's longest
sequence, chosen and rejected in one forward pass). TRL's defaults changed for this benchmark:
float32 (bf16=False), gradient_checkpointing=False (it only costs time at this size), no logging,
saving or evaluation. `--option key=value` overrides any trl.RewardConfig field (strings parsed as
JSON where they parse, e.g. `--option gradient_checkpointing=true`).

A step's time is the wall time between consecutive `on_step_end` callbacks (the first from
`on_train_begin`): next batch + forward/backward + optimizer step + TRL's per-step bookkeeping.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench_common import (
    BATCH_PAIRS,
    LEARNING_RATE,
    MODEL,
    SEED,
    Result,
    StepClock,
    read_workload,
    run_guarded,
    runner_args,
)


def main() -> None:
    args = runner_args(__doc__)
    result = Result(framework="trl", workload=Path(args.workload_dir).name, warmup=args.warmup)
    run_guarded(result, args.out, lambda r: train(r, args))


def _parse(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def train(result: Result, args) -> None:
    import datasets
    import torch
    import transformers
    import trl
    from trl.trainer.reward_trainer import DataCollatorForPreference

    result.version = trl.__version__
    n_steps = args.warmup + args.steps
    meta, rows = read_workload(args.workload_dir, n_steps * BATCH_PAIRS)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(args.tokenizer_dir)
    torch.manual_seed(SEED)
    hf_config = transformers.LlamaConfig(
        **{k: v for k, v in MODEL.items() if k != "architecture"},
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model = transformers.AutoModelForSequenceClassification.from_config(
        hf_config, dtype=torch.float32
    )
    clock, tokens = StepClock(), {"real": 0, "computed": 0, "batches": 0}

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock.start()

        def on_step_end(self, *a, **k):
            clock.step_done()

    class CountingCollator(DataCollatorForPreference):
        """TRL's collator, counting real vs padded tokens of the batches the steps train on."""

        def torch_call(self, examples):
            batch = super().torch_call(examples)
            if tokens["batches"] < n_steps:
                tokens["batches"] += 1
                tokens["real"] += int(batch["attention_mask"].sum())
                tokens["computed"] += batch["attention_mask"].numel()
            return batch

    settings = {
        "per_device_train_batch_size": BATCH_PAIRS,
        "learning_rate": LEARNING_RATE,
        "max_length": meta["max_length"],
        "max_steps": n_steps,
        "seed": SEED,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "gradient_checkpointing": False,
        "logging_strategy": "no",
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    settings.update({k: _parse(v) for k, v in (o.split("=", 1) for o in args.option)})
    with tempfile.TemporaryDirectory(prefix="trl-compare-") as out_dir:
        config = trl.RewardConfig(output_dir=out_dir, **settings)
        trainer = trl.RewardTrainer(
            model=model,
            args=config,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tok,
            data_collator=CountingCollator(pad_token_id=tok.pad_token_id),
            callbacks=[Clock()],
        )
        kept = len(trainer.train_dataset)
        if kept != len(rows):
            result.notes.append(f"TRL's max_length filter kept {kept} of {len(rows)} rows")
        trainer.train()
    result.step_times = clock.times
    result.real_tokens, result.computed_tokens = tokens["real"], tokens["computed"]
    result.compile_detail = "eager PyTorch (no compilation)"
    result.notes.append(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
