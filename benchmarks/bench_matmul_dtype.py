"""model.matmul_dtype: SmolLM2-135M gradient time with float32 vs bfloat16 projection matmuls.

    .venv/bin/python benchmarks/bench_matmul_dtype.py [--rows 4] [--length 128] [--pairs 5]

Part 1, the three matmuls of one MLP projection's training step at SmolLM2's shape (x [512, 576],
kernel [576, 1536]): forward x @ W, input gradient dy @ W^T, weight gradient x^T dy, each in
float32 and with bfloat16 inputs (float32 accumulation), the weight gradient once as XLA sees it
by default (both operands contracted on their first axis) and once through
`transformer._physical_transpose` (what `mixed_matmul` does). Prints the best of 3 x 20 calls.

Part 2, the gradient of the summed rewards of `--rows` x `--length` random tokens through the
bundled SmolLM2-135M-Instruct (float32 parameters) in three settings: float32, bf16 matmuls
(`matmul_dtype=bfloat16`) and bf16 activations (`dtype=bfloat16`); all compiled first, then
called in turn `--pairs` times so that machine noise hits them alike. Prints each setting's sorted
times, its median ratio to float32, its minor page faults per call (fresh memory the step
touches), and how far the bf16-matmul gradients are from the float32 ones (relative L2 error per
tensor). bf16 pays off only on CPUs with bf16 units
(`amx_bf16` / `avx512_bf16` in /proc/cpuinfo, printed); without them XLA upcasts the dots.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import rewardax as rx
from rewardax.models import smollm2_gguf_path
from rewardax.models.transformer import _physical_transpose


def _best(fn, *args, repeats: int = 3, calls: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def matmul_layouts() -> dict:
    m, k, n = 512, 576, 1536
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k))
    w = jax.random.normal(keys[1], (k, n))
    dy = jax.random.normal(keys[2], (m, n))
    bf, f32 = jnp.bfloat16, jnp.float32
    first_axes = (((0,), (0,)), ((), ()))
    last_axes = (((1,), (1,)), ((), ()))

    def dot(a, b, dims=(((1,), (0,)), ((), ())), dtype=f32):
        return jax.lax.dot_general(
            a.astype(dtype), b.astype(dtype), dims, preferred_element_type=f32
        )

    cases = {
        "forward x@W": lambda x, w, dy, d: dot(x, w, dtype=d),
        "input grad dy@W^T": lambda x, w, dy, d: dot(dy, w, last_axes, dtype=d),
        "weight grad x^T dy": lambda x, w, dy, d: dot(x, dy, first_axes, dtype=d),
    }
    out = {}
    for dtype in (f32, bf):
        for name, fn in cases.items():
            ms = _best(jax.jit(lambda x, w, dy, fn=fn, d=dtype: fn(x, w, dy, d)), x, w, dy)
            out[f"{jnp.dtype(dtype).name} {name}"] = round(ms * 1e3, 2)
    ms = _best(jax.jit(lambda x, dy: dot(_physical_transpose(x.astype(bf)), dy, dtype=bf)), x, dy)
    out["bfloat16 weight grad, physical transpose"] = round(ms * 1e3, 2)
    return {"matmul_ms": out, "gflop_per_matmul": round(2 * m * k * n / 1e9, 3)}


def gradient_ab(rows: int, length: int, pairs: int) -> dict:
    ids = jax.random.randint(jax.random.key(1), (rows, length), 3, 49152)
    mask = jnp.ones((rows, length), jnp.int32)
    settings = {  # name: (dtype, matmul_dtype); parameters float32 in all three
        "float32": ("float32", None),
        "bfloat16": ("float32", "bfloat16"),
        "bf16_activations": ("bfloat16", None),
    }
    programs = {}
    for name, (dtype, matmul_dtype) in settings.items():
        model = rx.AutoRewardModel.from_pretrained(
            smollm2_gguf_path(), dtype=dtype, param_dtype="float32", matmul_dtype=matmul_dtype
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p, graphdef=graphdef, rest=rest):
            return jnp.sum(nnx.merge(graphdef, p, rest)(ids, mask).logits)

        grad = jax.jit(jax.grad(loss)).lower(params).compile()
        jax.block_until_ready(grad(params))
        programs[name] = (grad, params)
    times: dict[str, list[float]] = {name: [] for name in programs}
    faults: dict[str, int] = dict.fromkeys(programs, 0)
    for _ in range(pairs):
        for name, (grad, params) in programs.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            jax.block_until_ready(grad(params))
            times[name].append(time.perf_counter() - start)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    ref = jax.tree.leaves(programs["float32"][0](programs["float32"][1]))
    got = jax.tree.leaves(programs["bfloat16"][0](programs["bfloat16"][1]))
    rel = sorted(
        float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) for a, b in zip(ref, got, strict=True)
    )
    medians = {name: statistics.median(v) for name, v in times.items()}
    return {
        "shape": [rows, length],
        "seconds": {name: [round(t, 3) for t in sorted(v)] for name, v in times.items()},
        "median_ratio_over_float32": {
            name: round(medians[name] / medians["float32"], 3) for name in medians
        },
        "minor_page_faults_per_call": {name: n // pairs for name, n in faults.items()},
        "grad_rel_err_median": round(rel[len(rel) // 2], 4),
        "grad_rel_err_max": round(rel[-1], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    units = sorted({f for f in flags if f in ("amx_bf16", "avx512_bf16", "amx_tile")})
    print(json.dumps({"devices": str(jax.devices()), "cpu_bf16_units": units}))
    print(json.dumps(matmul_layouts()))
    print(json.dumps(gradient_ab(args.rows, args.length, args.pairs)))


if __name__ == "__main__":
    main()
