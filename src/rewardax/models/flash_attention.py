"""rewardax's own Pallas TPU flash attention: causal, within segments, grouped queries.

Not selected by default: on a TPU v5e it ran slower than splash (Qwen2.5-0.5B heads, bf16,
16 x 2048: forward 3.93 ms against 3.21, backward 6.09 against 5.25; benchmarks/README.md,
2026-12-07 sixth session). It is kept, tested, as the base for kernel work on attention's speed.

Written for the shapes reward models train on: heads of 64 or 128, a few key/value heads shared
by groups of query heads, rows of 512-4096 tokens. Against JAX's splash kernel (which serves every
mask: `pallas_attention`) it differs where those shapes spend their time:
- the forward pass multiplies the probabilities by v in the inputs' dtype (bf16) with float32
  accumulation; splash's forward casts v to float32 for that product;
- the backward pass is one kernel per key/value head: its grid runs over the group's query heads
  and the query tiles innermost, so dk and dv of a key tile are summed over the whole group in
  VMEM and k, v are read once per tile; dq is written per key tile (float32) and summed after;
- tiles that the causal mask rules out are neither computed nor read: the tile index maps clamp
  to the last (first) tile a row needs, so the pipeline fetches nothing new for them.

Layouts, heads-major: q [N, H, T, D] (already scaled), k and v [N, K, T, D], H a multiple of K
(query head h reads key/value head h // (H / K)), segment ids [N, T] (a query sees the keys at
or before it with its own id). T must be a multiple of every tile; `pallas_attention` pads.

Inside a tile the scores of a forward step are [block_q, block_kv] (keys in lanes), those of a
backward step [block_kv, block_q] (queries in lanes), so each pass reduces over the axis that is
cheap for it and every product is a plain or a once-transposed one. Row statistics (running max,
sum, log-sum-exp) are kept 128 lanes wide in VMEM, as the vector unit holds them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_LANES = 128
# A score the mask rules out. Finite: a row whose keys so far are all masked gets probabilities
# exp(0) = 1 for them, which the first visible key's max then scales to 0 (every query sees at
# least itself, so each row has one).
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


class FlashTiles(NamedTuple):
    """Tiles (multiples of 128 dividing T): forward queries x keys, backward queries x keys."""

    block_q: int
    block_kv: int
    bwd_block_q: int
    bwd_block_kv: int


def _dot(a, b, contract: tuple[int, int]):
    """a @ b contracting a's axis contract[0] with b's contract[1], float32 results; float32
    operands at full precision (the kernel's float32 path, tests), others in one pass."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _div(a, b: int):
    """a // b for the non-negative indices of a kernel (its lowering has no signed floor)."""
    return jax.lax.div(a, b)


def _lanes(x: jax.Array, width: int) -> jax.Array:
    """[rows, 128] (a statistic repeated over the lanes) -> [rows, width]."""
    return x if width == _LANES else jnp.tile(x, (1, width // _LANES))


def _one_segment(a: jax.Array, b: jax.Array) -> jax.Array:
    """Whether every segment id in the two tiles' ids is the same one (then the segment mask
    rules nothing out and is not computed)."""
    return jnp.logical_and(jnp.max(a) == jnp.min(b), jnp.min(a) == jnp.max(b))


def _dispatch(step, needed, on_diagonal, one_segment) -> None:
    """``step(on_diagonal, segments)`` for a needed tile pair: the causal mask only on tiles the
    diagonal crosses, the segment mask only where the tiles hold more than one segment."""
    for diagonal in (False, True):
        for segments in (False, True):
            cond = jnp.logical_and(needed, on_diagonal if diagonal else ~on_diagonal)
            cond = jnp.logical_and(cond, ~one_segment if segments else one_segment)
            pl.when(cond)(functools.partial(step, diagonal, segments))


# ----------------------------------------------------------------------------- forward


def _forward_kernel(
    q_seg_ref,  # [bq, 128] int32: the queries' segment ids, repeated over the lanes
    kv_seg_ref,  # [1, bk] int32
    q_ref,  # [bq, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    o_ref,  # [bq, D]
    lse_ref,  # [1, bq] float32
    m_ref,  # scratch [bq, 128] float32: running max
    l_ref,  # scratch [bq, 128] float32: running sum
    acc_ref,  # scratch [bq, D] float32
    *,
    bq: int,
    bk: int,
):
    i, j = pl.program_id(2), pl.program_id(3)
    q_first, k_first = i * bq, j * bk
    last = jnp.minimum(pl.num_programs(3) - 1, _div(q_first + bq - 1, bk))

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, _MASKED)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(on_diagonal: bool, segments: bool):
        s = _dot(q_ref[...], k_ref[...], (1, 1))  # [bq, bk]
        seen = None
        if segments:
            seen = _lanes(q_seg_ref[...], bk) == kv_seg_ref[...]
        if on_diagonal:
            rows = q_first + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
            cols = k_first + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
            seen = cols <= rows if seen is None else seen & (cols <= rows)
        if seen is not None:
            s = jnp.where(seen, s, _MASKED)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 128]
        p = jnp.exp(s - _lanes(m_next, bk))
        alpha = jnp.exp(m_prev - m_next)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        d = acc_ref.shape[-1]
        pv = _dot(p.astype(v_ref.dtype), v_ref[...], (1, 0))  # [bq, D]
        acc_ref[...] = acc_ref[...] * alpha[:, :d] + pv

    # A key tile wholly before the query tile needs no causal mask.
    on_diagonal = k_first + bk - 1 > q_first
    _dispatch(step, j <= last, on_diagonal, _one_segment(q_seg_ref[...], kv_seg_ref[...]))

    @pl.when(j == last)
    def _finish():
        d = acc_ref.shape[-1]
        total = l_ref[...]
        o_ref[...] = (acc_ref[...] / total[:, :d]).astype(o_ref.dtype)
        lse = m_ref[...] + jnp.log(total)  # [bq, 128], every lane the same
        lse_ref[...] = lse.T[:1, :]


def _forward(q, k, v, seg, tiles: FlashTiles, interpret: bool):
    n, h, t, d = q.shape
    groups = h // k.shape[1]
    bq, bk = tiles.block_q, tiles.block_kv
    if d > _LANES:
        raise ValueError(f"flash attention takes heads of up to {_LANES}, not {d}")

    def kv_tile(n_, h_, i, j):  # the last key tile query tile i needs, for those after it
        return n_, _div(h_, groups), jnp.minimum(j, _div(i * bq + bq - 1, bk)), 0

    q_seg = jnp.broadcast_to(seg[:, :, None], (n, t, _LANES))
    kv_seg = seg[:, None, :]
    kernel = functools.partial(_forward_kernel, bq=bq, bk=bk)
    o, lse = pl.pallas_call(
        kernel,
        grid=(n, h, t // bq, t // bk),
        in_specs=[
            pl.BlockSpec((None, bq, _LANES), lambda n_, h_, i, j: (n_, i, 0)),
            pl.BlockSpec((None, 1, bk), lambda n_, h_, i, j: (n_, 0, kv_tile(n_, h_, i, j)[2])),
            pl.BlockSpec((None, None, bq, d), lambda n_, h_, i, j: (n_, h_, i, 0)),
            pl.BlockSpec((None, None, bk, d), kv_tile),
            pl.BlockSpec((None, None, bk, d), kv_tile),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, d), lambda n_, h_, i, j: (n_, h_, i, 0)),
            pl.BlockSpec((None, None, 1, bq), lambda n_, h_, i, j: (n_, h_, 0, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((n, h, 1, t), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, d), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(q_seg, kv_seg, q, k, v)
    return o, lse


# ---------------------------------------------------------------------------- backward


def _backward_kernel(
    q_seg_ref,  # [1, bq] int32
    kv_seg_ref,  # [bk, 128] int32: the keys' segment ids, repeated over the lanes
    q_ref,  # [bq, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    do_ref,  # [bq, D]
    lse_ref,  # [1, bq] float32
    di_ref,  # [1, bq] float32: rowsum(o * do)
    dq_ref,  # [bq, D] float32: this key tile's part of dq
    dk_ref,  # [bk, D]
    dv_ref,  # [bk, D]
    dk_acc,  # scratch [bk, D] float32
    dv_acc,  # scratch [bk, D] float32
    *,
    bq: int,
    bk: int,
):
    j, head, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    q_first, k_first = i * bq, j * bk
    first = _div(k_first, bq)  # the first query tile that sees a key of this tile

    @pl.when(jnp.logical_and(head == 0, i == 0))
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    def step(on_diagonal: bool, segments: bool):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = _dot(k, q, (1, 1))  # [bk, bq]: keys in sublanes, queries in lanes
        seen = None
        if segments:
            seen = _lanes(kv_seg_ref[...], bq) == q_seg_ref[...]
        if on_diagonal:
            keys = k_first + jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
            queries = q_first + jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
            seen = keys <= queries if seen is None else seen & (keys <= queries)
        if seen is not None:
            s = jnp.where(seen, s, _MASKED)
        p = jnp.exp(s - lse_ref[...])  # [bk, bq]
        dv_acc[...] += _dot(p.astype(do.dtype), do, (1, 0))
        dp = _dot(v, do, (1, 1))  # [bk, bq]
        ds = (p * (dp - di_ref[...])).astype(q.dtype)
        dk_acc[...] += _dot(ds, q, (1, 0))
        dq_ref[...] = _dot(ds, k, (0, 0))  # [bq, D]

    # A query tile wholly after the key tile needs no causal mask.
    on_diagonal = q_first < k_first + bk - 1
    _dispatch(step, i >= first, on_diagonal, _one_segment(q_seg_ref[...], kv_seg_ref[...]))

    @pl.when(jnp.logical_and(head == pl.num_programs(3) - 1, i == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _backward(q, k, v, seg, o, lse, do, tiles: FlashTiles, interpret: bool):
    n, h, t, d = q.shape
    kv_heads = k.shape[1]
    groups = h // kv_heads
    bq, bk = tiles.bwd_block_q, tiles.bwd_block_kv
    nq, nk = t // bq, t // bk

    def q_tile(j, i):  # query tiles before the first that sees key tile j: that first one
        return jnp.maximum(i, _div(j * bk, bq))

    def q_spec(n_, g, j, head, i):
        return n_, g * groups + head, q_tile(j, i), 0

    def row_spec(n_, g, j, head, i):
        return n_, g * groups + head, 0, q_tile(j, i)

    def kv_spec(n_, g, j, head, i):
        return n_, g, j, 0

    di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)[:, :, None, :]
    kernel = functools.partial(_backward_kernel, bq=bq, bk=bk)
    dq_parts, dk, dv = pl.pallas_call(
        kernel,
        grid=(n, kv_heads, nk, groups, nq),
        in_specs=[
            pl.BlockSpec((None, 1, bq), lambda n_, g, j, head, i: (n_, 0, q_tile(j, i))),
            pl.BlockSpec((None, bk, _LANES), lambda n_, g, j, head, i: (n_, j, 0)),
            pl.BlockSpec((None, None, bq, d), q_spec),
            pl.BlockSpec((None, None, bk, d), kv_spec),
            pl.BlockSpec((None, None, bk, d), kv_spec),
            pl.BlockSpec((None, None, bq, d), q_spec),
            pl.BlockSpec((None, None, 1, bq), row_spec),
            pl.BlockSpec((None, None, 1, bq), row_spec),
        ],
        out_specs=[
            pl.BlockSpec(
                (None, None, None, bq, d),
                lambda n_, g, j, head, i: (j, *q_spec(n_, g, j, head, i)),
            ),
            pl.BlockSpec((None, None, bk, d), kv_spec),
            pl.BlockSpec((None, None, bk, d), kv_spec),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((nk, n, h, t, d), jnp.float32),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
    )(
        seg[:, None, :],
        jnp.broadcast_to(seg[:, :, None], (n, t, _LANES)),
        q,
        k,
        v,
        do,
        lse,
        di,
    )
    # Key tile j wrote dq parts for query tiles from (j * bk) // bq on; the others are unwritten.
    written = jnp.arange(nq)[None, :] >= (jnp.arange(nk)[:, None] * bk) // bq
    parts = dq_parts.reshape(nk, n, h, nq, bq, d)
    dq = jnp.where(written[:, None, None, :, None, None], parts, 0.0).sum(axis=0)
    return dq.reshape(n, h, t, d).astype(q.dtype), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def flash_attention_heads_major(q, k, v, segment_ids, tiles: FlashTiles, interpret: bool):
    """Causal attention within segments: q [N, H, T, D] (scaled), k, v [N, K, T, D], segment ids
    int [N, T] -> [N, H, T, D] in q's dtype (see the module's docstring)."""
    return _forward(q, k, v, segment_ids, tiles, interpret)[0]


def _vjp_forward(q, k, v, segment_ids, tiles, interpret):
    o, lse = _forward(q, k, v, segment_ids, tiles, interpret)
    return o, (q, k, v, segment_ids, o, lse)


def _vjp_backward(tiles, interpret, residuals, do):
    q, k, v, segment_ids, o, lse = residuals
    dq, dk, dv = _backward(q, k, v, segment_ids, o, lse, do, tiles, interpret)
    return dq, dk, dv, None


flash_attention_heads_major.defvjp(_vjp_forward, _vjp_backward)
