"""What the float32 gradient sums of bf16 compute cost on the accelerator: RewardTrainer's step
timed with each of the three (the embedding's rows, the RMSNorm weight's product, the projection
bias's add; benchmarks/bf16_gradient_sums.py measures their error) put back to the bf16
formulation they replaced, one at a time and all three, in one run, "now" first and last.

    python benchmarks/bf16_sums_speed.py [--budget-s 300] [--steps 8] [--out DIR] [--tiny]

Shapes: Qwen2.5-0.5B (it has biases) at 512 tokens, save_attention, 16 pairs (what `auto`
chooses), then at 2048, 1 pair x 8 microbatches, now against all three bf16. Results: the
table printed, rows in OUT/tpu_bench.jsonl (with "variant").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpu_bench as tb
from rewardax.models import transformer


def _bf16_norm(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def _bf16_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    return y + bias.astype(y.dtype)


def _bf16_embed(table: jax.Array, ids: jax.Array) -> jax.Array:
    # `nnx.Embed` with bf16 compute: the table cast before the lookup
    return jnp.take(table.astype(jnp.bfloat16), ids, axis=0)


REPLACED = {  # name: (owner, attribute, the bf16 formulation)
    "norm": (transformer.RMSNorm, "__call__", _bf16_norm),
    "bias": (transformer, "add_bias", _bf16_bias),
    "embed": (transformer, "embed_rows", _bf16_embed),
}
VARIANTS = {
    "now": (),
    "bf16 norm": ("norm",),
    "bf16 bias": ("bias",),
    "bf16 embed": ("embed",),
    "bf16 all": ("norm", "bias", "embed"),
}


@contextlib.contextmanager
def replaced(names: tuple[str, ...]):
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in map(REPLACED.get, names)]
    try:
        for name in names:
            owner, attr, fn = REPLACED[name]
            setattr(owner, attr, fn)
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


class VariantRecorder(tb.Recorder):
    """Each row labelled with the variant that ran it."""

    variant = ""

    def add(self, row: dict) -> None:
        super().add({**row, "variant": self.variant})


RUNS = [  # (variant, job); "now" first and last: the run's drift
    *[(v, tb.Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention")) for v in VARIANTS],
    ("now", tb.Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention")),
    *[
        (v, tb.Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=8))
        for v in ("now", "bf16 all")
    ],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=300.0, help="no job starts after this")
    parser.add_argument("--reserve-s", type=float, default=40.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hbm-gib", type=float, default=15.75)
    parser.add_argument("--out", default=os.environ.get("OUT") or "tpu_bench_out")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script")
    args = parser.parse_args()
    args.profile = 0
    if args.tiny:
        args.steps = 2
    rec = VariantRecorder(Path(args.out))
    kernels = tb.select_kernels("pallas")
    with tempfile.TemporaryDirectory() as workdir:
        for variant, job in RUNS:
            if args.tiny:
                job = tb.dataclasses.replace(job, length=128, batches=(2 * job.microbatches,))
            rec.variant = variant
            with replaced(VARIANTS[variant]):
                tb.train_job(job, kernels, args, rec, workdir)
    print("| variant | T | pairs | step s | MFU | HBM GiB | status |")
    print("|---|---|---|---|---|---|---|")
    for r in rec.rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        step = f"{r['step_s']:.4f}" if r.get("step_s") else ""
        hbm = f"{r['hbm_gib']:.2f}" if r.get("hbm_gib") else ""
        print(
            f"| {r['variant']} | {r['T']} | {r['pairs']} | {step} | {mfu} | {hbm} | {r['status']} |"
        )
    print(f"backend {jax.default_backend()}", flush=True)


if __name__ == "__main__":
    main()
