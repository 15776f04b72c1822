"""One training step of issue #4's recipe, ready to time: shared by the step benchmarks.

SmolLM2-135M-Instruct (bf16 projection matmuls), batch 8, shared_prompt rows of 128 or 192 tokens,
AdamW 2e-5 with 5 warmup steps and linear decay, on the bundled VADER train split. A caller that
wants `rewardax.hostmem.retain_freed_memory()` applies it before calling `recipe_step`, which starts JAX.
"""

from __future__ import annotations

import itertools
from importlib import resources
from typing import Any


def recipe_step(save_directory: str, shape: tuple[int, int] = (4, 128)) -> tuple[Any, Any, Any]:
    """(jitted train step, state arrays, device batch of `shape` rows x tokens), not yet compiled.

    Draws the recipe's batches in order until one has `shape`; SystemExit if an epoch has none.
    """
    import rewardax as rx
    from rewardax import distributed
    from rewardax.models import smollm2_gguf_path
    from rewardax.sharding import global_batch
    from rewardax.trainer import _model_inputs

    tokenizer = rx.load_tokenizer(smollm2_gguf_path())
    model = rx.AutoRewardModel.from_pretrained(smollm2_gguf_path(), matmul_dtype="bfloat16", seed=0)
    config = rx.RewardConfig(
        per_device_train_batch_size=8,
        learning_rate=2e-5,
        warmup_steps=5,
        schedule="linear",
        max_sequence_length=64,
        layout="shared_prompt",
        bucket_lengths=[128, 192],
        save_directory=save_directory,
        progress_bar=False,
        seed=42,
    )
    train = resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl"
    trainer = rx.RewardTrainer(config, tokenizer, model=model, train_dataset=str(train))
    fns = trainer.configure_functions()
    loader = trainer.train_loader
    batches = distributed.lockstep(loader, loader.pad_id)
    for host_batch in itertools.islice(batches, trainer.total_steps):  # the recipe's one epoch
        if host_batch["input_ids"].shape == tuple(shape):
            return (
                fns.train_step,
                trainer.state.arrays(),
                global_batch(_model_inputs(host_batch), trainer.mesh),
            )
    raise SystemExit(f"no batch of shape {tuple(shape)} in one epoch of the recipe")
