"""Held-out rewards of one trained tiny model under each kernel setting, float32 and with bf16
matmuls (`model.matmul_dtype`), on the backend at hand.

    python benchmarks/matmul_dtype_check.py [--out DIR]

On the TPU, tests/test_trainer.py's check that bf16 matmuls stay within 0.05 of the float32
rewards failed (2026-12-06: 5 of 8 rewards off by up to 0.19) while the CPU agrees to 1e-3 for
every kernel setting. This prints each setting's rewards next to the float32 `cpu` ones, to see
which formulation departs. Needs the SmolLM2 tokenizer (REWARDAX_TEST_TOKENIZER on the TPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama

ASSETS = Path(rx.__file__).parent / "assets"


def rows(name: str, n: int) -> list[dict]:
    with open(ASSETS / name, encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def config(tmp: Path, **overrides) -> rx.RewardConfig:
    return rx.RewardConfig(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=2,
        max_sequence_length=64,
        save_directory=str(tmp),
        progress_bar=False,
        seed=7,
        **overrides,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the rewards as JSON here")
    args = parser.parse_args()
    tokenizer = smollm2_tokenizer()
    heldout = rows("vader_movie_pairs.heldout.jsonl", 8)
    with tempfile.TemporaryDirectory() as tmp:
        trained = rx.RewardTrainer(
            config(Path(tmp), max_training_steps=3, run_name="train"),
            tokenizer,
            model=tiny_llama(tokenizer),
            train_dataset=rows("vader_movie_pairs.train.jsonl", 32),
        ).train()
        found = {}
        for kernels in ("cpu", "xla", "pallas"):
            for matmul in (None, "bfloat16"):
                name = f"{kernels}/{matmul or 'float32'}"
                try:
                    trainer = rx.RewardTrainer(
                        config(
                            Path(tmp),
                            run_name=name.replace("/", "-"),
                            path=str(trained.export_dir),
                            dtype="float32",
                            matmul_dtype=matmul,
                            kernels=kernels,
                        ),
                        tokenizer,
                        eval_dataset=heldout,
                    )
                    trainer.evaluate()
                    found[name] = [float(x) for x in trainer._last_rewards["eval"]["chosen"]]
                except Exception as exc:  # one setting's failure is a result
                    found[name] = f"{type(exc).__name__}: {exc}"[:300]
    reference = np.asarray(found["cpu/float32"])
    for name, got in found.items():
        if isinstance(got, str):
            print(f"{name:18s} {got}")
            continue
        diff = np.max(np.abs(np.asarray(got) - reference))
        print(f"{name:18s} max |diff| {diff:.4f}  {np.round(got, 4).tolist()}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "matmul_dtype_check.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
