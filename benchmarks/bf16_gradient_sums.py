"""How far bf16 compute's parameter gradients that sum over tokens are from a float64 sum: the
embedding's rows of a repeated token, a norm's weight, a projection's bias.

For each, rewardax's formulation (the sum taken in float32: `transformer.embed_rows`, `RMSNorm`,
`project`) against the one it replaced on 2026-12-07 (the sum taken in bf16: `nnx.Embed` with a
bf16 dtype, a bf16 product with the weight, a bf16 bias add), on this machine's XLA backend.
Errors are relative to the largest reference value.

Usage:
    .venv/bin/python benchmarks/bf16_gradient_sums.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rewardax.models.transformer import Projection, RMSNorm, embed_rows

ROWS, LENGTH, WIDTH = 8, 2048, 64  # 16384 tokens
VOCAB, LOOKUPS = 16, 4000  # three tokens read ~1333 times each


def relative_error(grad: jax.Array, reference: np.ndarray) -> tuple[float, float]:
    diff = np.abs(np.asarray(grad, np.float64) - reference) / np.abs(reference).max()
    return float(diff.max()), float(diff.mean())


def embedding(rng: np.random.Generator) -> dict[str, tuple[float, float]]:
    table = jnp.asarray(rng.normal(size=(VOCAB, WIDTH)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, 3, size=(LOOKUPS,)))
    weights = jnp.asarray(rng.normal(size=(LOOKUPS, WIDTH))).astype(jnp.bfloat16)
    reference = np.zeros((VOCAB, WIDTH))
    np.add.at(reference, np.asarray(ids), np.asarray(weights, np.float64))

    def loss(rows):
        return jnp.sum(rows.astype(jnp.bfloat16).astype(jnp.float32) * weights)

    new = jax.grad(lambda t: loss(embed_rows(t, ids)))(table)
    embed = nnx.Embed(VOCAB, WIDTH, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(embed)
    state["embedding"].set_value(table)
    old = jax.grad(lambda st: loss(nnx.merge(graphdef, st)(ids)))(state)["embedding"][...]
    used = slice(0, 3)
    return {
        "float32 sum (embed_rows)": relative_error(new[used], reference[used]),
        "bf16 sum (nnx.Embed, bf16)": relative_error(old[used], reference[used]),
    }


def norm_and_bias(rng: np.random.Generator) -> dict[str, tuple[float, float]]:
    x = jnp.asarray(rng.normal(size=(ROWS, LENGTH, WIDTH)), jnp.bfloat16)
    weights = jnp.asarray(rng.normal(size=(ROWS, LENGTH, WIDTH)), jnp.bfloat16)

    def loss(y):
        return jnp.sum((y * weights).astype(jnp.float32))

    norm = RMSNorm(WIDTH, 1e-6, names=("norm",), param_dtype=jnp.float32)
    graphdef, state = nnx.split(norm)
    new_norm = jax.grad(lambda st: loss(nnx.merge(graphdef, st)(x)))(state)["weight"][...]
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    normed16 = normed.astype(jnp.bfloat16)
    old_norm = jax.grad(lambda w: loss(w.astype(jnp.bfloat16) * normed16))(jnp.ones(WIDTH))
    norm_reference = np.sum(
        np.asarray(normed16, np.float64) * np.asarray(weights, np.float64), axis=(0, 1)
    )

    proj = Projection(
        (WIDTH,),
        (WIDTH,),
        ("embed", "mlp"),
        use_bias=True,
        std=0.02,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(proj)
    new_bias = jax.grad(lambda st: loss(nnx.merge(graphdef, st)(x)))(state)["bias"][...]
    y = proj(x)
    old_bias = jax.grad(lambda b: loss(y + b.astype(jnp.bfloat16)))(jnp.zeros(WIDTH))
    bias_reference = np.sum(np.asarray(weights, np.float64), axis=(0, 1))
    return {
        "norm weight, float32 product (RMSNorm)": relative_error(new_norm, norm_reference),
        "norm weight, bf16 product": relative_error(old_norm, norm_reference),
        "bias, float32 add (project)": relative_error(new_bias, bias_reference),
        "bias, bf16 add": relative_error(old_bias, bias_reference),
    }


def main() -> None:
    rng = np.random.default_rng(0)
    results = {**embedding(rng), **norm_and_bias(rng)}
    print(f"backend {jax.default_backend()}; error relative to the largest reference value")
    print(f"{'gradient':<42} {'max':>10} {'mean':>10}")
    for name, (worst, mean) in results.items():
        print(f"{name:<42} {worst:>10.2e} {mean:>10.2e}")


if __name__ == "__main__":
    main()
