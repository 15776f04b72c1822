"""Where attention's time goes inside the kernels on a TPU (issue 28: attention alone at 25-28%
of peak in device time, target 35%).

Qwen2.5-0.5B heads (14 query, 2 key/value heads of 64), bf16, 16 x 2048 tokens, q/k/v already
heads-major [N, H, T, D] (no wrapper around the kernels). Each variant is timed back to back
(`ITERS` calls, waited for once) and traced (`PROFILE` calls): the figure that counts is the
kernels' device time ("kernel_ms", the profile's attention-kernel ops per call).

- splash (JAX's kernel, forward + backward): the model's tiles, then one change each: no
  segment ids; the causal mask as stored blocks (`NumpyMask`) instead of computed per element;
  k, q or v given sequence-minor (`QKVLayout.SEQ_MINOR`, the transposes outside the kernels
  are not counted in kernel_ms); dq in its own kernel (not fused).
- flash (rewardax's `flash_attention`, forward + backward) at three tilings; flash forward and
  flash backward (rewardax's `flash_attention`, each alone) at a few tiles,
  then ablations at the first tiling (`flash_attention._forward`'s and `_backward`'s
  ``ablate``): no diagonal split, split down to 128, the scale on the queries, no mask, no exp,
  no p·v; backward: no split, split to 128, scale on the queries, no dq. An ablated kernel
  does not compute attention; the time it saves is what that part costs.

Usage: python benchmarks/attention_ablation.py [--budget-s S] [--out DIR] [--tiny]
(on a TPU: `BENCH=benchmarks/attention_ablation.py bash benchmarks/tpu_run.sh`; --tiny: small
shapes in interpret mode, a check of the script). Results: OUT/attention_ablation.{jsonl,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

sys.path.insert(0, str(Path(__file__).parent))
import device_profile
from rewardax.models import flash_attention as fa
from rewardax.models.kernels import select_kernels
from rewardax.models.pallas_attention import splash_block_sizes
from tpu_bench import back_to_back_seconds

PEAK_FLOPS = 197e12  # v5e bf16
ITERS = 20
PROFILE = 3
SEQ_MINOR = splash.QKVLayout.SEQ_MINOR

SPLASH_VARIANTS = [  # name, changes
    ("model tiles", {}),
    ("no segment ids", {"segments": False}),
    ("causal mask as stored blocks", {"numpy_mask": True}),
    ("k sequence-minor", {"k_layout": SEQ_MINOR}),
    ("q sequence-minor", {"q_layout": SEQ_MINOR}),
    ("v sequence-minor", {"v_layout": SEQ_MINOR}),
    (
        "q, k, v sequence-minor",
        {"q_layout": SEQ_MINOR, "k_layout": SEQ_MINOR, "v_layout": SEQ_MINOR},
    ),
    ("dq kernel apart", {"fused": False}),
]
# (query tile, key chunk): the forward's; (query chunk, key tile): the backward's.
FLASH_TILES = [(1024, 1024, 512, 512), (512, 512, 512, 512)]
FLASH_FORWARD_TILES = [(1024, 1024), (512, 512), (1024, 512)]
FORWARD_ABLATIONS = [
    ("no_split",),
    ("split_128",),
    ("scale_queries",),
    ("no_mask",),
    ("no_exp",),
    ("no_pv",),
    ("no_mask", "no_exp", "no_pv"),
]
FLASH_BACKWARD_TILES = [(512, 512), (1024, 1024)]
BACKWARD_ABLATIONS = [("no_split",), ("split_128",), ("scale_queries",), ("no_dq",)]


def kernel_ms(fn, args: tuple, calls: int) -> tuple[float | None, dict]:
    """(the attention kernels' device ms per call, {kernel op name: ms}) from a trace."""

    def run() -> None:
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)

    summary = device_profile.trace_ops(run, calls)
    ops = {o["name"]: o["ms"] for o in summary["ops"] if o["class"] == "attention kernel"}
    total = next((c["ms"] for c in summary["classes"] if c["name"] == "attention kernel"), None)
    return total, {"device_ms": summary["device_ms"], **ops}


def splash_fn(t: int, heads: int, fields: dict, change: dict, interpret: bool):
    """fwd+bwd of JAX's splash kernel on heads-major q/k/v, with one change."""
    sizes = splash_block_sizes(
        t,
        fields["block_q"],
        fields["block_kv"],
        change.get("fused", fields["fused_backward"]),
        block_kv_compute=fields["block_kv_compute"],
        bwd_block_q=fields["bwd_block_q"],
        bwd_block_kv=fields["bwd_block_kv"],
    )
    layouts = {k: v for k, v in change.items() if k.endswith("_layout")}
    if layouts:
        sizes = splash.BlockSizes(**{**_fields(sizes), **layouts})
    if change.get("numpy_mask"):
        causal = splash_mask.NumpyMask(np.tril(np.ones((t, t), dtype=np.bool_)))
    else:
        causal = splash_mask.CausalMask((t, t))
    mask = splash_mask.MultiHeadMask([causal] * heads)
    segments = change.get("segments", True)

    def attend(q, k, v, seg):
        kernel = splash.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )
        if segments:
            one = lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s))  # noqa: E731
            return jax.vmap(one)(q, k, v, seg)
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v))(q, k, v, seg)

    def both(q, k, v, seg):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
        return vjp(jnp.ones_like(out))

    return jax.jit(both)


def _fields(sizes: splash.BlockSizes) -> dict:
    names = [
        "block_q",
        "block_kv",
        "block_kv_compute",
        "block_q_dkv",
        "block_kv_dkv",
        "block_kv_dkv_compute",
        "block_q_dq",
        "block_kv_dq",
        "use_fused_bwd_kernel",
    ]
    return {n: getattr(sizes, n) for n in names}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=400)
    parser.add_argument("--out", default=os.environ.get("OUT", "attention_ablation_out"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--only", default="", help="the groups whose name contains this")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    interpret = jax.default_backend() != "tpu"
    start = time.monotonic()
    n, t, h, kv, d = (1, 256, 4, 2, 64) if args.tiny else (16, 2048, 14, 2, 64)
    iters, calls = (1, 1) if args.tiny else (ITERS, PROFILE)
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(n, h, t, d)) / np.sqrt(d), jnp.bfloat16)
    k = jnp.asarray(r.normal(size=(n, kv, t, d)), jnp.bfloat16)
    v = jnp.asarray(r.normal(size=(n, kv, t, d)), jnp.bfloat16)
    do = jnp.asarray(r.normal(size=(n, h, t, d)), jnp.bfloat16)
    seg = jnp.ones((n, t), jnp.int32)
    flops = {"fwd+bwd": 3.5 * 2 * n * h * t * t * d}
    flops["fwd"] = flops["fwd+bwd"] * 2 / 7
    flops["bwd"] = flops["fwd+bwd"] * 5 / 7
    fields = {
        f: getattr(select_kernels("pallas"), f)
        for f in [
            "block_q",
            "block_kv",
            "block_kv_compute",
            "bwd_block_q",
            "bwd_block_kv",
            "fused_backward",
        ]
    }
    if args.tiny:
        fields |= dict.fromkeys(("block_q", "block_kv", "block_kv_compute"), 128)
        fields |= dict.fromkeys(("bwd_block_q", "bwd_block_kv"), 128)

    jobs = []  # (group, name, part, fn, args)
    for name, change in SPLASH_VARIANTS:
        jobs.append(
            (
                "splash",
                name,
                "fwd+bwd",
                lambda c=change: splash_fn(t, h, fields, c, interpret),
                (q, k, v, seg),
            )
        )

    def flash_both(tiles):
        ft = fa.FlashTiles(*tiles)

        def both(q, k, v, seg):
            out, vjp = jax.vjp(
                lambda q, k, v: fa.flash_attention_heads_major(q, k, v, seg, ft, interpret), q, k, v
            )
            return vjp(jnp.ones_like(out))

        return jax.jit(both)

    for tiles in [(128,) * 4] if args.tiny else FLASH_TILES:
        name = "fwd {}x{} bwd {}x{}".format(*tiles)
        jobs.append(("flash", name, "fwd+bwd", lambda tl=tiles: flash_both(tl), (q, k, v, seg)))

    def flash_forward(tiles, ablate=()):
        ft = fa.FlashTiles(*tiles, *tiles)
        return jax.jit(
            lambda q, k, v, s: fa._forward(q, k, v, s, ft, interpret, ablate=frozenset(ablate))
        )

    fwd_tiles = [(128, 128)] if args.tiny else FLASH_FORWARD_TILES
    bwd_tiles = [(128, 128)] if args.tiny else FLASH_BACKWARD_TILES
    base = fa.FlashTiles(*fwd_tiles[0], *fwd_tiles[0])
    o, lse = jax.jit(lambda q, k, v, s: fa._forward(q, k, v, s, base, interpret))(q, k, v, seg)

    def flash_backward(tiles, ablate=()):
        ft = fa.FlashTiles(*tiles, *tiles)
        return jax.jit(
            lambda q, k, v, s, o, lse, do: fa._backward(
                q, k, v, s, o, lse, do, ft, interpret, ablate=frozenset(ablate)
            )
        )

    # Each kernel alone at its tilings, then its ablations at the first tiling.
    for group, part, make, tilings, ablations, operands in (
        ("flash forward", "fwd", flash_forward, fwd_tiles, FORWARD_ABLATIONS, (q, k, v, seg)),
        (
            "flash backward",
            "bwd",
            flash_backward,
            bwd_tiles,
            BACKWARD_ABLATIONS,
            (q, k, v, seg, o, lse, do),
        ),
    ):
        variants = [(tiles, ()) for tiles in tilings] + [(tilings[0], a) for a in ablations]
        for tiles, ablate in variants:
            name = f"{tiles[0]}x{tiles[1]}" + (" " + "+".join(ablate) if ablate else "")
            run = lambda make=make, tiles=tiles, ablate=ablate: make(tiles, ablate)  # noqa: E731
            jobs.append((group, name, part, run, operands))

    rows = []
    jobs = [job for job in jobs if args.only in job[0]]
    for group, name, part, make, operands in jobs:
        row = {"group": group, "variant": name, "part": part, "N": n, "T": t}
        if time.monotonic() - start > args.budget_s:
            row["status"] = "budget"
        else:
            try:
                fn = make()
                row["program_ms"] = round(1e3 * back_to_back_seconds(fn, operands, iters), 3)
                total, ops = kernel_ms(fn, operands, calls)
                row["kernel_ms"] = total
                row["ops"] = ops
                if total:
                    row["kernel_peak"] = round(flops[part] / (total / 1e3) / PEAK_FLOPS, 4)
                row["program_peak"] = round(flops[part] / (row["program_ms"] / 1e3) / PEAK_FLOPS, 4)
                row["status"] = "ok"
            except Exception as exc:  # a variant the compiler refuses is a result too
                traceback.print_exc()
                row["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        with (out / "attention_ablation.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
    pct = lambda x: "" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        f"Attention kernels on {jax.devices()[0].device_kind}, Qwen2.5-0.5B heads, bf16, "
        f"{n} x {t}, heads-major inputs; % of the bf16 peak for the part timed (causal flops: "
        "fwd 2, bwd 5 of 3.5 x 2 x N x H x T^2 x D).",
        "",
        "| kernel | variant | part | program ms (back to back) | kernel device ms | kernel % of peak | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r_ in rows:
        lines.append(
            f"| {r_['group']} | {r_['variant']} | {r_['part']} | {r_.get('program_ms', '')} | "
            f"{r_.get('kernel_ms', '')} | {pct(r_.get('kernel_peak'))} | {r_['status']} |"
        )
    (out / "attention_ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
