"""Compiles splash attention (forward + backward) for a TPU on this machine, on segment ids and on
the shared-prompt tree's dynamic mask, and prints what XLA:TPU made of each: its temporaries and
the Mosaic kernels it calls. Nothing runs; libtpu describes the chip (`rewardax plan`'s way).

    PYTHONPATH=.venv/libtpu JAX_PLATFORMS=cpu .venv/bin/python benchmarks/compile_tree_attention.py \\
        [--topology v5e:1x1] [--rows 16] [--length 2048]

Shapes: Qwen2.5-0.5B's heads (14 query, 2 key/value heads of 64), bf16, `Kernels`' default tiles.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from rewardax.models.pallas_attention import splash_attention
from rewardax.plan import topology_devices

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


def compile_one(tree: bool, rows: int, length: int, device) -> dict:
    sharding = SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    q = spec((rows, length, HEADS, HEAD_DIM), jnp.bfloat16)
    kv = spec((rows, length, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    ids = spec((rows, length), jnp.int32)

    def gradients(q, k, v, segments, branches):
        def attention(q, k, v):
            branch_ids = branches if tree else None
            return splash_attention(q, k, v, segments, HEAD_DIM**-0.5, branch_ids=branch_ids)

        out, vjp = jax.vjp(attention, q, k, v)
        return vjp(jnp.ones_like(out))

    start = time.perf_counter()
    compiled = jax.jit(gradients).lower(q, kv, kv, ids, ids).compile()
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    return {
        "mask": "tree (dynamic)" if tree else "segment ids (static)",
        "compile_s": time.perf_counter() - start,
        "temp_gib": memory.temp_size_in_bytes / 2**30,
        "mosaic_kernels": text.count('custom_call_target="tpu_custom_call"'),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args()
    device = topology_devices(args.topology)[0]
    print(f"{args.topology}, {args.rows} rows x {args.length} tokens, forward + backward")
    for tree in (False, True):
        r = compile_one(tree, args.rows, args.length, device)
        print(
            f"{r['mask']}: compiled in {r['compile_s']:.1f} s, temporaries {r['temp_gib']:.3f} "
            f"GiB, {r['mosaic_kernels']} Mosaic kernels",
            flush=True,
        )


if __name__ == "__main__":
    main()
