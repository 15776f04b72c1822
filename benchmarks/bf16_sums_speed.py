"""What the float32 gradient sums of bf16 compute cost on the accelerator: RewardTrainer's step
timed with each of the three (the embedding's rows, the RMSNorm weight's product, the projection
bias's add; benchmarks/bf16_gradient_sums.py measures their error) in float32 and in the bf16
formulation they replaced, one at a time and all three, in one run, "float32" first and last.
Since 2026-12-07 a TPU's kernels take the norm and the bias in bf16 (`Kernels.float32_sums`,
chosen from this script's figures): "float32" here sets it, "bf16 norm" and "bf16 bias" replace
one of the two, "bf16 norm and bias" is what a TPU runs by default.

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

FLOAT32 = dict(float32_sums=True)
_norm, _add_bias = transformer.RMSNorm.__call__, transformer.add_bias


def _bf16_norm(self, x: jax.Array, kernels=None) -> jax.Array:
    kernels = kernels or tb.select_kernels("cpu")
    return _norm(self, x, tb.dataclasses.replace(kernels, float32_sums=False))


def _bf16_bias(y: jax.Array, bias: jax.Array, in_float32: bool = True) -> jax.Array:
    return _add_bias(y, bias, False)


def _bf16_embed(table: jax.Array, ids: jax.Array) -> jax.Array:
    # `nnx.Embed` with bf16 compute: the table cast before the lookup
    return jnp.take(table.astype(jnp.bfloat16), ids, axis=0)


REPLACED = {  # name: (owner, attribute, the bf16 formulation)
    "norm": (transformer.RMSNorm, "__call__", _bf16_norm),
    "bias": (transformer, "add_bias", _bf16_bias),
    "embed": (transformer, "embed_rows", _bf16_embed),
}
VARIANTS = {  # name: (Kernels fields, what is replaced)
    "float32": (FLOAT32, ()),
    "bf16 norm": (FLOAT32, ("norm",)),
    "bf16 bias": (FLOAT32, ("bias",)),
    "bf16 embed": (FLOAT32, ("embed",)),
    "bf16 norm and bias": (dict(float32_sums=False), ()),
    "bf16 all": (FLOAT32, ("norm", "bias", "embed")),
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


SHORT = tb.Job("qwen2.5-0.5b", 512, "pallas", (16,), remat="save_attention")
LONG = tb.Job("qwen2.5-0.5b", 2048, "pallas", (8,), remat="save_attention", microbatches=8)
RUNS = [  # (variant, job); "float32" first and last: the run's drift
    *[(v, SHORT) for v in VARIANTS],
    ("float32", SHORT),
    *[(v, LONG) for v in ("float32", "bf16 norm and bias", "bf16 all")],
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
            fields, names = VARIANTS[variant]
            with replaced(names):
                job = tb.dataclasses.replace(job, tiles=fields)
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
