"""A trained tiny model's held-out rewards in training, after export and reload (each kernel
setting, float32 and bf16 matmuls), and its parameters before and after the round trip, on the
backend at hand.

    python benchmarks/export_roundtrip_check.py [--out DIR]

On a TPU v5e (2026-12-06) the rewards of the reloaded export differed from the same model's
rewards in training (8 held-out rows: 0.2653 -> 0.1051, ...; every kernel setting of the reload
agreed with the others, bf16 matmuls within 1e-3 of float32), while the training rewards equalled
the CPU's to 4 digits and the CPU's round trip is exact. This prints, to find which side departs:
the trained model's rewards on the same 8 rows (the object, no export), the reload's under each
kernel setting, and the largest difference of each parameter between the trained state and the
reloaded model. Needs the SmolLM2 tokenizer (REWARDAX_TEST_TOKENIZER on the TPU).

Found with it (2026-12-06, second session): only the token embedding departed, in the file
already: `jax.device_get` on the TPU returned it column-major (strides (4, 196608)) and
safetensors wrote that memory as a row-major tensor. `models.registry.to_hf` now returns
C-contiguous arrays (tests/test_models_reward.py fakes a column-major device_get).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama
from test_trainer import make_config as config  # the failing test's own settings

ASSETS = Path(rx.__file__).parent / "assets"


def rows(name: str, n: int) -> list[dict]:
    with open(ASSETS / name, encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def embed_check(export_dir: Path, before: dict, after: dict, initial) -> None:
    """Where the token embedding departs: the trained state, the exported file, the reload, and
    the untrained model's (a stale copy would equal it), row by row."""
    from safetensors.numpy import load_file

    path = ("model", "embed_tokens", "embedding")
    saved = {}
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        saved.update(load_file(str(f)))
    host = jax.device_get(before[path][...])
    print(
        f"trained embedding on the host: {type(host).__name__} {host.dtype} {host.shape} "
        f"strides {getattr(host, 'strides', None)} sharding {before[path][...].sharding}"
    )
    arrays = {
        "trained": np.asarray(host, np.float32),
        "file": np.asarray(saved["model.embed_tokens.weight"], np.float32),
        "reloaded": np.asarray(jax.device_get(after[path][...]), np.float32),
        "initial": np.asarray(
            jax.device_get(dict(nnx.to_flat_state(nnx.state(initial, nnx.Param)))[path][...]),
            np.float32,
        ),
    }
    names = list(arrays)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            rows = np.flatnonzero(np.any(arrays[a] != arrays[b], axis=1))
            print(
                f"embed {a:8s} vs {b:8s}: {rows.size} rows differ, first {rows[:8].tolist()}, "
                f"max {float(np.max(np.abs(arrays[a] - arrays[b]))):.3g}"
            )
    # A device round trip of an array of the same shape, alone.
    x = np.random.default_rng(0).normal(size=arrays["trained"].shape).astype(np.float32)
    y = np.asarray(jax.device_get(jax.numpy.asarray(x)))
    print(
        f"host->device->host of a {x.shape} float32 array: max diff {float(np.max(np.abs(x - y)))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the rewards as JSON here")
    args = parser.parse_args()
    tokenizer = smollm2_tokenizer()
    heldout = rows("vader_movie_pairs.heldout.jsonl", 8)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = rx.RewardTrainer(
            config(Path(tmp), max_training_steps=3, run_name="train"),
            tokenizer,
            model=tiny_llama(tokenizer),
            train_dataset=rows("vader_movie_pairs.train.jsonl", 32),
            eval_dataset=heldout,
        )
        trained = trainer.train()
        trained_state = trainer.state
        found = {"in training": [float(x) for x in trainer._last_rewards["eval"]["chosen"]]}
        # The trained model itself, as the trainer holds it, on the same rows.
        probe = rx.RewardTrainer(
            config(Path(tmp), run_name="trained-object"),
            tokenizer,
            model=trained_state.model,
            eval_dataset=heldout,
        )
        probe.evaluate()
        found["trained object"] = [float(x) for x in probe._last_rewards["eval"]["chosen"]]
        reloaded = rx.AutoRewardModel.from_pretrained(str(trained.export_dir))
        before = dict(nnx.to_flat_state(nnx.state(trained_state.model, nnx.Param)))
        after = dict(nnx.to_flat_state(nnx.state(reloaded, nnx.Param)))
        embed_check(trained.export_dir, before, after, tiny_llama(tokenizer))
        for path, value in before.items():
            a = np.asarray(jax.device_get(value[...]), np.float32)
            b = np.asarray(jax.device_get(after[path][...]), np.float32)
            diff = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("nan")
            print(f"param {'.'.join(map(str, path)):40s} max |trained - reloaded| {diff:.3g}")
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
    reference = np.asarray(found["in training"])
    for name, got in found.items():
        if isinstance(got, str):
            print(f"{name:18s} {got}")
            continue
        diff = np.max(np.abs(np.asarray(got) - reference))
        print(f"{name:18s} max |diff| {diff:.4f}  {np.round(got, 4).tolist()}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "export_roundtrip_check.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
