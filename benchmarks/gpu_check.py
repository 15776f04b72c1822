"""Training throughput on the machine's accelerators: tokens/s and MFU of the jitted train step.

Two jobs, each timed over `--steps` steps after two warm-up (compile) steps, all local devices on
an fsdp mesh:
  - `default`: the built-in default job's model (SmolLM2-135M-Instruct) and settings on VADER pairs;
  - `qwen2-0.5b`: a Qwen2-0.5B-shaped model (random weights, bf16 compute, float32 master weights)
    on random 2048-token pairs, with full rematerialisation.

MFU = (6 × parameters + 12 × layers × hidden × T) × computed tokens / time / (devices × peak),
counting padded positions as computed (they are), peak = `--peak-tflops` per device (H200 / H100
SXM dense bf16: 989).

Usage:
    .venv/bin/python benchmarks/gpu_check.py [--jobs default,qwen2-0.5b] [--steps 10] [--tiny]

`--tiny` shrinks both jobs so the script itself can be checked on a CPU. Prints one line per job and,
last, one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

import jax
import numpy as np
from flax import nnx

import rewardax as rx
from rewardax.config import RewardConfig
from rewardax.models import smollm2_gguf_path
from rewardax.sharding import global_batch

MODEL_KEYS = ("input_ids", "attention_mask", "reward_index", "margin", "pair_mask")


def qwen2_05b(tiny: bool) -> rx.ModelConfig:
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        shape.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
    else:  # Qwen/Qwen2-0.5B's config.json
        shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
        shape.update(num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)
    return rx.ModelConfig(
        architecture="qwen2",
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        pad_token_id=0,
        **shape,
    )


def random_pairs(n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = lambda: rng.integers(3, vocab, size=length).tolist()  # noqa: E731
    return [{"chosen_input_ids": ids(), "rejected_input_ids": ids()} for _ in range(n)]


def time_steps(trainer: rx.RewardTrainer, steps: int) -> dict:
    fns = trainer.configure_functions()
    arrays = trainer.state.arrays()
    batches = iter(trainer.train_loader)
    for _ in range(2):  # compile + one more
        arrays, metrics = fns.train_step(arrays, global_batch(_inputs(next(batches)), trainer.mesh))
    jax.block_until_ready(metrics)
    host = [next(batches) for _ in range(steps)]
    tokens = sum(int(b["attention_mask"].size) for b in host)
    real = sum(int(b["attention_mask"].sum()) for b in host)
    start = time.perf_counter()
    for b in host:
        arrays, metrics = fns.train_step(arrays, global_batch(_inputs(b), trainer.mesh))
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    t = host[0]["input_ids"].shape[-1]
    return {
        "seconds": seconds,
        "tokens": tokens,
        "real_tokens": real,
        "seq_len": t,
        "loss": float(metrics["loss"]),
    }


def _inputs(batch: dict) -> dict:
    return {k: batch[k] for k in MODEL_KEYS}


def flops_per_token(model: rx.RewardModel, seq_len: int) -> float:
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    c = model.config
    return 6.0 * params + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len


def run(job: str, args: argparse.Namespace) -> dict:
    n = jax.device_count()
    tok = rx.load_tokenizer(str(smollm2_gguf_path()))
    common = dict(
        max_training_steps=1000,
        save_directory="/tmp/rewardax_gpu_check",
        resume="off",
        progress_bar=False,
        mesh={"dp": 1, "fsdp": -1, "tp": 1},
    )
    if job == "default":
        config = RewardConfig.from_yaml(resources.files("rewardax") / "configs" / "default.yaml")
        config = config.with_overrides([f"{k}={v}" for k, v in _flat(common).items()])
        model = rx.AutoRewardModel.from_pretrained(str(smollm2_gguf_path()), dtype="float32")
        assets = resources.files("rewardax") / "assets"
        data = str(assets / "vader_movie_pairs.train.jsonl")
    else:
        length = 64 if args.tiny else 2048
        config = RewardConfig(
            per_device_train_batch_size=1 if args.tiny else 4,
            max_sequence_length=length,
            dtype="bfloat16",
            remat_policy="full",
            **common,
        )
        model = rx.RewardModel(
            qwen2_05b(args.tiny), dtype="bfloat16", remat_policy="full", rngs=nnx.Rngs(0)
        )
        rows = n * config.per_device_train_batch_size * (args.steps + 4)
        # length - 1 ids: room for the EOS the loader appends; ids valid for tokenizer and model.
        data = random_pairs(rows, length - 1, min(len(tok), model.config.vocab_size))
    trainer = rx.RewardTrainer(config, tok, model=model, train_dataset=data)
    timing = time_steps(trainer, args.steps)
    per_token = flops_per_token(model, timing["seq_len"])
    tokens_per_s = timing["tokens"] / timing["seconds"]
    mfu = per_token * tokens_per_s / (n * args.peak_tflops * 1e12)
    return {
        "job": job,
        "devices": n,
        "device_kind": jax.devices()[0].device_kind,
        "tokens_per_second": tokens_per_s,
        "real_tokens_per_second": timing["real_tokens"] / timing["seconds"],
        "seq_len": timing["seq_len"],
        "steps": args.steps,
        "mfu": mfu,
        "final_loss": timing["loss"],
    }


def _flat(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", default="default,qwen2-0.5b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    results = []
    for job in args.jobs.split(","):
        r = run(job, args)
        results.append(r)
        print(
            f"{job}: {r['tokens_per_second']:.0f} tokens/s on {r['devices']} x "
            f"{r['device_kind']} (T={r['seq_len']}), MFU {100 * r['mfu']:.1f}%",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
