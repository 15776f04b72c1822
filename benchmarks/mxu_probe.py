"""What the TPU's matrix units give inside a Pallas kernel for the products of attention with
64-wide heads (issue 28: attention alone at ~18-27% of peak).

Each product is timed as a kernel that multiplies VMEM-resident bf16 (or float32) operands
`REPEATS` times per grid step, cycling through the row slices of a left operand of up to 4 MiB
(so nothing is loop-invariant), accumulating in float32: HBM traffic is one load per grid step, so the
figure is the matrix unit's rate for that shape and operand type, in % of the chip's bf16 peak.

Shapes (M x K x N, "nt": the right operand given [N, K], as q k^T is):
- q k^T and dO v^T of attention with head_dim 64: 512 x 64 x 512 nt (contraction 64);
- p v in splash's forward: 512 x 512 x 64, float32 p and v (splash casts v to float32) and bf16;
- the same product transposed (v^T p^T): 64 x 512 x 512;
- references: 512 x 128 x 512 nt, 512 x 512 x 128, 512 x 512 x 512.

Usage: python benchmarks/mxu_probe.py [--budget-s S] [--out DIR] [--tiny]
(on a TPU via `BENCH=benchmarks/mxu_probe.py bash benchmarks/tpu_run.sh`; --tiny: interpret mode
on any backend, a check of the script). Results: OUT/mxu_probe.jsonl and OUT/mxu_probe.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

PEAK_FLOPS = 197e12  # v5e bf16
REPEATS = 64
STEPS = 16
SLICE_BYTES = 4 << 20  # the left operand's block (double-buffered by the pipeline)
# (name, M, K, N, right operand given [N, K], operand dtype)
PRODUCTS = [
    ("q k^T, head 64", 512, 64, 512, True, jnp.bfloat16),
    ("p v, float32 (splash forward)", 512, 512, 64, False, jnp.float32),
    ("p v, bf16", 512, 512, 64, False, jnp.bfloat16),
    ("v^T p^T, bf16", 64, 512, 512, False, jnp.bfloat16),
    ("reference 512 x 128 x 512 nt", 512, 128, 512, True, jnp.bfloat16),
    ("reference 512 x 512 x 128", 512, 512, 128, False, jnp.bfloat16),
    ("reference 512 x 512 x 512", 512, 512, 512, False, jnp.bfloat16),
]


def product_kernel(m: int, transposed: bool, repeats: int, slices: int):
    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))

    def kernel(a_ref, b_ref, o_ref):
        def body(i, acc):
            a = a_ref[pl.ds(pl.multiple_of((i % slices) * m, m), m), :]
            return acc + jax.lax.dot_general(
                a, b_ref[...], dims, preferred_element_type=jnp.float32
            )

        o_ref[...] = jax.lax.fori_loop(0, repeats, body, jnp.zeros(o_ref.shape, jnp.float32))

    return kernel


def time_product(m, k, n, transposed, dtype, repeats, steps, iters, interpret) -> float:
    """Seconds per call of `steps` grid steps of `repeats` products each (median of iters)."""
    # a block of k < 128 columns is laid out in 128-wide tiles
    slices = max(1, min(repeats, SLICE_BYTES // (m * max(k, 128) * jnp.dtype(dtype).itemsize)))
    r = np.random.default_rng(0)
    a = jnp.asarray(r.normal(size=(steps, slices * m, k)), dtype)
    b = jnp.asarray(r.normal(size=(n, k) if transposed else (k, n)), dtype)
    call = pl.pallas_call(
        product_kernel(m, transposed, repeats, slices),
        grid=(steps,),
        in_specs=[
            pl.BlockSpec((None, slices * m, k), lambda s: (s, 0, 0)),
            pl.BlockSpec(b.shape, lambda s: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, m, n), lambda s: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((steps, m, n), jnp.float32),
        interpret=interpret,
    )
    fn = jax.jit(call)
    jax.block_until_ready(fn(a, b))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(a, b))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--out", default=os.environ.get("OUT", "mxu_probe_out"))
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    interpret = jax.default_backend() != "tpu"
    repeats, steps, iters = (2, 2, 1) if args.tiny else (REPEATS, STEPS, 10)
    start = time.monotonic()
    rows = []
    for name, m, k, n, transposed, dtype in PRODUCTS:
        row = dict(product=name, M=m, K=k, N=n, dtype=jnp.dtype(dtype).name)
        if time.monotonic() - start > args.budget_s:
            row["status"] = "budget"
        else:
            try:
                s = time_product(m, k, n, transposed, dtype, repeats, steps, iters, interpret)
                flops = 2 * m * k * n * repeats * steps
                row |= dict(ms=round(1e3 * s, 3), peak=round(flops / s / PEAK_FLOPS, 4))
                row["status"] = "ok"
            except Exception as exc:  # a shape the kernel compiler refuses is a result too
                row["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        with (out / "mxu_probe.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
    lines = [
        f"Pallas products on {jax.devices()[0].device_kind}: {repeats} per grid step, "
        f"{steps} steps; % of the bf16 peak ({PEAK_FLOPS / 1e12:.0f} TFLOP/s).",
        "",
        "| product | M x K x N | operands | ms | % of peak | status |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{100 * r['peak']:.1f}%" if "peak" in r else ""
        lines.append(
            f"| {r['product']} | {r['M']} x {r['K']} x {r['N']} | {r['dtype']} | "
            f"{r.get('ms', '')} | {peak} | {r['status']} |"
        )
    (out / "mxu_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
