"""Attention kernels compiled for a TPU v5e on the CPU, read as scheduled instruction bundles
(issue 28): how long one step of a kernel's inner loop is against the matrix units' bound.

libtpu compiles for a v5e topology without a chip (`rewardax.plan.topology_devices`) and dumps
each program's final VLIW bundles (``--xla_jf_dump_to``, ``--xla_jf_dump_llo_text``). In the
Pallas kernel's dump every predicated region or loop body that holds matrix-unit pushes
(``vmatmul``) and no region that does is one step of the kernel's inner loop (one tile pair, in
each of its mask variants). For each such region: its bundles (one bundle issues per cycle when
nothing stalls), its ``vmatmul`` count, and the matrix units' bound: a push carries one vreg of
rows (16 of bf16, 8 of float32), a unit takes one 128-wide row per cycle (4 units x 128 x 128
multiply-adds x 1.5 GHz = the v5e's 197 TFLOP/s), so rows / 4 cycles (float32 rows counted as
one pass: a lower bound). With heads of 64 every push is half used (64 of the contraction's 128 rows, or 64 of
the output's 128 columns), so a step at its bound runs at 50% of the chip's peak.

What the bundles do not show: time stalled on the matrix units or on DMAs, the grid's per-step
cost, steps the kernel skips. Those take the chip (`attention_ablation.py`).

Usage: python benchmarks/kernel_bundles.py [--out DIR] [--only NAME]
(needs libtpu: `make .venv/libtpu/.installed`; takes a few minutes). Results: OUT/kernel_bundles.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_LIBTPU = _ROOT / ".venv" / "libtpu"
_DUMP = tempfile.mkdtemp(prefix="kernel_bundles_")
os.environ["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_to={_DUMP} --xla_jf_dump_llo_text=true"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if _LIBTPU.exists():
    sys.path.insert(0, str(_LIBTPU))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: E402
    splash_attention_kernel as splash,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: E402
    splash_attention_mask as splash_mask,
)

from rewardax.models import flash_attention as fa  # noqa: E402
from rewardax.models.pallas_attention import splash_block_sizes  # noqa: E402
from rewardax.plan import topology_devices  # noqa: E402

N, H, KV, T, D = 16, 14, 2, 2048, 64  # Qwen2.5-0.5B heads, the attention bench's 16 x 2048
SCALE = 0.125  # 1 / sqrt(D)
UNITS = 4
_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s")
_REGION = re.compile(r"(Start|End) region (\d+)")


def _bf16(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def _splash(fused_bwd: bool):
    sizes = splash_block_sizes(T, 1024, 1024, True, block_kv_compute=512)
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((T, T))] * H)

    def attend(q, k, v, s):
        kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
        one = lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s))  # noqa: E731
        return jax.vmap(one)(q, k, v, s)

    if not fused_bwd:
        return attend

    def both(q, k, v, s):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, s), q, k, v)
        return vjp(jnp.ones_like(out))

    return both


def _flash_forward(bq: int, bc: int):
    tiles = fa.FlashTiles(bq, bc, 512, 512)
    return lambda q, k, v, s: fa._forward(q, k, v, s, tiles, False, SCALE)


def _flash_backward(bq: int, bk: int):
    tiles = fa.FlashTiles(512, 512, bq, bk)
    return lambda q, k, v, s, o, lse, do: fa._backward(q, k, v, s, o, lse, do, tiles, False, SCALE)


QKVS = [
    _bf16(N, H, T, D),
    _bf16(N, KV, T, D),
    _bf16(N, KV, T, D),
    jax.ShapeDtypeStruct((N, T), jnp.int32),
]
RESIDUALS = [
    *QKVS,
    _bf16(N, H, T, D),
    jax.ShapeDtypeStruct((N, H, 1, T), jnp.float32),
    _bf16(N, H, T, D),
]
# name, the kernel's name in the dump, function, arguments
KERNELS = [
    (
        "splash forward (model tiles: 1024 x 1024, 512 keys per step)",
        "splash_mha_fwd",
        _splash(False),
        QKVS,
    ),
    ("splash fused backward (model tiles)", "splash_mha_dkv", _splash(True), QKVS),
    ("flash forward 512 x 512", "flash_forward", _flash_forward(512, 512), QKVS),
    ("flash forward 1024 x 512", "flash_forward", _flash_forward(1024, 512), QKVS),
    ("flash forward 1024 x 1024", "flash_forward", _flash_forward(1024, 1024), QKVS),
    ("flash backward 512 x 512", "flash_backward", _flash_backward(512, 512), RESIDUALS),
    (
        "flash backward 512 x 1024 (queries x keys)",
        "flash_backward",
        _flash_backward(512, 1024),
        RESIDUALS,
    ),
]


def compile_for_v5e(fn, avals) -> None:
    device = topology_devices("v5e:1x1")[0]
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh([device], ("x",)), jax.sharding.PartitionSpec()
    )
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
    jax.jit(fn).lower(*args).compile()


def inner_steps(path: Path) -> list[dict]:
    """The innermost regions holding matrix-unit pushes: bundles, pushes, op counts."""
    lines = path.read_text().splitlines()
    regions, open_ = [], []
    for i, line in enumerate(lines):
        for kind, name in _REGION.findall(line):
            if kind == "Start":
                open_.append((name, i))
                continue
            for j in range(len(open_) - 1, -1, -1):
                if open_[j][0] == name:
                    regions.append((open_.pop(j)[1], i))
                    break

    def count(a: int, b: int) -> collections.Counter:
        c = collections.Counter()
        for line in lines[a : b + 1]:
            c["bundles"] += bool(_BUNDLE.match(line))
            for op in re.findall(r"= (v[a-z0-9.]+)", line):
                c[op.split(".")[0]] += 1
                if op.startswith("vmatmul"):  # a bf16 vreg holds 16 rows, a float32 one 8
                    c["rows"] += 16 if ".bf16" in op else 8
        return c

    with_pushes = [(a, b, count(a, b)) for a, b in regions]
    with_pushes = [(a, b, c) for a, b, c in with_pushes if c["vmatmul"]]
    steps = []
    for a, b, c in with_pushes:
        inner = any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2, _ in with_pushes)
        if not inner:
            bound = c["rows"] / UNITS
            steps.append({**c, "first_line": a, "bound": bound, "of_bound": bound / c["bundles"]})
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "kernel_bundles_out"))
    parser.add_argument("--only", default=None, help="kernels whose name contains this")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"Attention kernels compiled for a v5e on the CPU ({N} x {T}, 14 query / 2 key-value "
        "heads of 64, bf16). One row per inner step region (mask variants are separate regions).",
        "matrix-unit bound = rows pushed (16 per bf16 vmatmul, 8 per float32) / 4 units, in "
        "cycles; % = bound / bundles (over 100%: the step waits on the matrix units).",
        "",
        "| kernel | step region | bundles | vmatmul | matrix-unit bound | % of bundles | "
        "vld | vst | vpow2 (exp) | vsel (masks) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, dump_name, fn, avals in KERNELS:
        if args.only and args.only not in name:
            continue
        before = set(os.listdir(_DUMP))
        compile_for_v5e(fn, avals)
        new = [f for f in set(os.listdir(_DUMP)) - before]
        dumps = [
            f
            for f in new
            if dump_name in f and f.endswith("-final_bundles.txt") and "schedule" not in f
        ]
        for dump in sorted(dumps):
            for k, step in enumerate(inner_steps(Path(_DUMP) / dump)):
                lines.append(
                    f"| {name} | {k + 1} | {step['bundles']} | {step['vmatmul']} | "
                    f"{step['bound']:.0f} | {100 * step['of_bound']:.0f}% | {step['vld']} | "
                    f"{step['vst']} | {step['vpow2']} | {step['vsel']} |"
                )
        print("\n".join(lines[-4:]), flush=True)
    (out / "kernel_bundles.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
