"""rewardax's own Pallas TPU flash attention: causal, within segments, grouped queries.

A TPU's attention for padded and packed rows (`Kernels.flash`; the tree mask and windows run
splash). Its first design (a grid over key tiles) ran slower than splash on a TPU v5e (16 x 2048
of Qwen2.5-0.5B heads: forward 3.93 ms against 3.21, backward 6.09 against 5.25;
benchmarks/README.md, 2026-12-07 sixth session). Compiled for a v5e on the CPU
(`benchmarks/kernel_bundles.py`), the steps of both kernels and of splash are at the matrix
units' bound, which heads of 64 halve: the time lost is outside the steps (tile pairs half
masked on the diagonal, the grid's steps, the tiles' DMAs). This design cuts those:

- the forward keeps each row's keys and values in VMEM (fetched once per key/value head, as
  the query heads of a group follow one another in the grid) and loops, inside the kernel, over
  the key chunks a query tile needs: no grid step and no DMA per tile pair; a tile's first
  chunk sets its statistics (no zeroing);
- the backward keeps the group's queries, output gradients and row statistics for the whole row
  in VMEM, with dq summed there in float32 across the key tiles; a key tile loops over the
  group's heads and the query chunks that see it, summing dk and dv in VMEM;
- a diagonal block runs as steps that leave out its all-masked upper right quarter, split again
  down to halves of 256 (`_split_diagonal`): ~1/8 of a 1024 block computed for nothing, where
  splash's 1024 x 1024 tiles compute half;
- masks only where needed: the causal mask on the diagonal's steps, the segment mask where a
  step's two tiles hold more than one segment id (a table computed before the kernel and read
  as scalars), the forward's p·v in the inputs' dtype (splash's forward casts v to float32);
- the scale goes on the keys, once per row and key/value head in the forward and per key tile in
  the backward, when it is a power of two (no rounding changes), else on q inside the kernels.

On a v5e, 16 x 2048 of Qwen2.5-0.5B's heads, tiles of 1024: forward 2.10 ms, backward 3.93
(35.4% of the chip's peak for causal attention's products; splash 3.21 and 5.25, 25.3%;
benchmarks/README.md, 2026-12-08).

VMEM bounds the row length: the backward holds about 8 x G x T x 128 bytes twice (G query
heads per key/value head), ~60 MiB for 7 heads at 4096 tokens; `vmem_bytes` says how much.

Layouts, heads-major: q [N, H, T, D] (unscaled: the kernels take ``scale``), k and v [N, K, T, D], H a multiple of K
(query head h reads key/value head h // (H / K)), segment ids [N, T] (a query sees the keys at
or before it with its own id). T must be a multiple of every tile; `pallas_attention` pads.

Inside a step the scores of the forward are [queries, keys] (keys in lanes), those of the
backward [keys, queries] (queries in lanes), so each pass reduces over the axis that is cheap
for it and every product is a plain or a once-transposed one. Row statistics (running max,
sum) are kept 128 lanes wide in VMEM, as the vector unit holds them.
"""

from __future__ import annotations

import functools
import math
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
    """Tiles (multiples of 128 dividing T): the forward's query tile (a grid step) and key chunk
    (a step of its loop), the backward's query chunk (a step of its loop) and key tile (a grid
    step)."""

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


def _masked(s, same_segment, on_diagonal: bool, q_first, k_first, query_axis: int):
    """Scores ``s`` (a step's tile pair, queries along ``query_axis``, keys along the other,
    starting at q_first and k_first) with what a query must not see set to `_MASKED`: keys of
    another segment (``same_segment``: bool, or None where the tiles hold one segment) and, on
    the diagonal, keys after it."""
    seen = same_segment
    if on_diagonal:
        queries = q_first + jax.lax.broadcasted_iota(jnp.int32, s.shape, query_axis)
        keys = k_first + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1 - query_axis)
        seen = keys <= queries if seen is None else seen & (keys <= queries)
    return s if seen is None else jnp.where(seen, s, _MASKED)


def _scaled(q: jax.Array, scale: float) -> jax.Array:
    """q x scale, in float32 then rounded once to q's dtype (exact for 1/8, heads of 64)."""
    if scale == 1.0:
        return q
    return (q.astype(jnp.float32) * scale).astype(q.dtype)


def _div(a, b: int):
    """a // b for the non-negative indices of a kernel (its lowering has no signed floor)."""
    return jax.lax.div(a, b)


def _lanes(x: jax.Array, width: int) -> jax.Array:
    """[rows, 128] (a statistic repeated over the lanes) -> [rows, width]."""
    return x if width == _LANES else jnp.tile(x, (1, width // _LANES))


# Diagonal blocks are split down to halves of this many tokens (`_split_diagonal`).
_SPLIT_MIN_HALF = 256


def _split_diagonal(size: int, ablate: frozenset[str]) -> bool:
    """Whether a diagonal block of ``size`` queries x ``size`` keys runs as two steps that leave
    out its upper right quarter, which the causal mask rules out whole."""
    half, smallest = size // 2, _LANES if "split_128" in ablate else _SPLIT_MIN_HALF
    return size % 2 == 0 and half % _LANES == 0 and half >= smallest and "no_split" not in ablate


def _scale_keys(scale: float, ablate: frozenset[str]) -> bool:
    """Whether a kernel puts the scale on the keys instead of the queries: a power of two only,
    so that the factor changes no rounding (scale·(q·kᵀ) the same either way)."""
    return scale > 0 and math.frexp(scale)[0] == 0.5 and "scale_queries" not in ablate


# ----------------------------------------------------------------------------- forward


def _mixed_tiles(seg: jax.Array, rows: int, cols: int) -> jax.Array:
    """int32 [N * (T / rows) * (T / cols)] (row-major over row, query tile, key tile): 1 where a
    tile of ``rows`` queries and one of ``cols`` keys hold more than one segment id between them
    (the segment mask is needed), else 0. Flat: SMEM pads a table's minor dimension (a
    [256, 8, 8] table overflowed a v5e's 1 MiB)."""
    n, t = seg.shape
    q_tiles, k_tiles = seg.reshape(n, t // rows, rows), seg.reshape(n, t // cols, cols)
    q_min, q_max = q_tiles.min(-1)[:, :, None], q_tiles.max(-1)[:, :, None]
    k_min, k_max = k_tiles.min(-1)[:, None, :], k_tiles.max(-1)[:, None, :]
    one = (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
    return (~one).astype(jnp.int32).reshape(-1)


def _forward_kernel(
    mixed_ref,  # SMEM int32 [N * T / bq * T / bc]: `_mixed_tiles`
    q_seg_ref,  # [bq, 128] int32: the queries' segment ids, repeated over the lanes
    kv_seg_ref,  # [1, T] int32: the row's segment ids
    q_ref,  # [bq, D]
    k_ref,  # [T, D]: the whole row's keys of this query head's key/value head
    v_ref,  # [T, D]
    o_ref,  # [bq, D]
    lse_ref,  # [1, bq] float32
    m_ref,  # scratch [bq, 128] float32: running max
    l_ref,  # scratch [bq, 128] float32: running sum
    acc_ref,  # scratch [bq, D] float32
    scaled_ref,  # scratch: k x scale [T, D] (a power of two), else q x scale [bq, D]
    *,
    bq: int,
    bc: int,
    scale: float,
    groups: int,
    ablate: frozenset[str] = frozenset(),
):
    n_, h_, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_first = i * bq
    d = acc_ref.shape[-1]
    if _scale_keys(scale, ablate):
        # Once per row and key/value head (its group's first query head, first tile; the grid
        # runs in order): scale·(q·kᵀ) is the same bit for bit with the factor on k.
        @pl.when((jax.lax.rem(h_, groups) == 0) & (i == 0))
        def _scale_keys_once():
            scaled_ref[...] = _scaled(k_ref[...], scale)

        q_tile, keys_ref = q_ref, scaled_ref
    else:
        scaled_ref[...] = _scaled(q_ref[...], scale)
        q_tile, keys_ref = scaled_ref, k_ref

    def pair(first, segments, on_diagonal, initial, row0=0, rows=bq, key0=0, keys=bc):
        """One step: queries [row0, row0 + rows) of the tile against the keys from
        first + key0 (static sizes); ``initial``: the rows' first step (it sets their
        statistics instead of updating them)."""
        r, kk = pl.ds(row0, rows), pl.ds(first + key0, keys)
        s = _dot(q_tile[r, :], keys_ref[kk, :], (1, 1))  # [rows, keys]
        if "no_mask" not in ablate:
            same = None
            if segments:
                same = _lanes(q_seg_ref[r, :], keys) == kv_seg_ref[:, kk]
            s = _masked(s, same, on_diagonal, q_first + row0, first + key0, query_axis=0)
        m_next = jnp.broadcast_to(jnp.max(s, axis=1, keepdims=True), (rows, _LANES))
        if not initial:
            m_prev = m_ref[r, :]
            m_next = jnp.maximum(m_prev, m_next)
        exp = (lambda x: x) if "no_exp" in ablate else jnp.exp
        p = exp(s - _lanes(m_next, keys))
        m_ref[r, :] = m_next
        pv = None
        if "no_pv" not in ablate:
            pv = _dot(p.astype(v_ref.dtype), v_ref[kk, :], (1, 0))  # [rows, D]
        if initial:
            l_ref[r, :] = jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), (rows, _LANES))
            acc_ref[r, :] = jnp.zeros((rows, d), jnp.float32) if pv is None else pv
            return
        alpha = exp(m_prev - m_next)
        l_ref[r, :] = alpha * l_ref[r, :] + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[r, :] = acc_ref[r, :] * alpha[:, :d] + (0.0 if pv is None else pv)

    def diagonal(first, segments, initial, size):
        """The tile's rows [0, size) against the keys first + [0, size), first == q_first."""
        if not _split_diagonal(size, ablate):
            pair(first, segments, True, initial, rows=size, keys=size)
            return
        # The upper right quarter is all masked: the first half of the rows against the first
        # half of the keys (split again), then the second half against all (rows of their
        # own: no step waits for the other's statistics).
        diagonal(first, segments, initial, size // 2)
        pair(first, segments, True, initial, size // 2, size // 2, 0, size)

    def chunk(c, on_diagonal: bool, initial: bool = False):
        first = pl.multiple_of(c * bc, bc)

        def step(segments: bool):
            if on_diagonal and bq == bc:
                diagonal(first, segments, initial, bq)
            else:
                pair(first, segments, on_diagonal, initial)

        mixed = mixed_ref[(n_ * pl.num_programs(2) + i) * (k_ref.shape[0] // bc) + c]
        pl.when(mixed == 0)(functools.partial(step, False))
        pl.when(mixed != 0)(functools.partial(step, True))

    # Key chunks wholly at or before the tile's first query need no causal mask; the chunks
    # after them, up to the tile's last query, do. Chunk 0, the first of one or the other,
    # sets the statistics.
    before = _div(q_first + 1, bc)
    through = _div(q_first + bq + bc - 1, bc)
    pl.when(before > 0)(lambda: chunk(0, False, initial=True))
    pl.when(before == 0)(lambda: chunk(0, True, initial=True))
    jax.lax.fori_loop(1, before, lambda c, _: chunk(c, False), None)
    jax.lax.fori_loop(jnp.maximum(before, 1), through, lambda c, _: chunk(c, True), None)
    total = l_ref[...]
    o_ref[...] = (acc_ref[...] / total[:, :d]).astype(o_ref.dtype)
    lse = m_ref[...] + jnp.log(total)  # [bq, 128], every lane the same
    lse_ref[...] = lse.T[:1, :]


def _forward(q, k, v, seg, tiles: FlashTiles, interpret: bool, scale=1.0, ablate=frozenset()):
    """o [N, H, T, D] and the log-sum-exp [N, H, 1, T] (float32) of softmax(scale q kᵀ) v. Each row's keys and values
    stay in VMEM: the grid runs over (row, query head, query tile of ``tiles.block_q``) and a
    query tile loops over the key chunks (``tiles.block_kv``) it needs inside the kernel.
    ``ablate`` (benchmarks/attention_ablation.py): "no_mask", "no_exp", "no_pv" leave that part
    out (the result is then not attention); "no_split", "split_128", "scale_queries" change
    how the diagonal is split and where the scale goes (the same attention)."""
    bq, bc = tiles.block_q, tiles.block_kv
    n, h, t, d = q.shape
    groups = h // k.shape[1]
    if d > _LANES:
        raise ValueError(f"flash attention takes heads of up to {_LANES}, not {d}")
    mixed = _mixed_tiles(seg, bq, bc)
    q_seg = jnp.broadcast_to(seg[:, :, None], (n, t, _LANES))
    kv_seg = seg[:, None, :]
    kernel = functools.partial(
        _forward_kernel, bq=bq, bc=bc, scale=scale, groups=groups, ablate=ablate
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(n, h, t // bq),
        in_specs=[
            pl.BlockSpec((None, bq, _LANES), lambda n_, h_, i, m: (n_, i, 0)),
            pl.BlockSpec((None, 1, t), lambda n_, h_, i, m: (n_, 0, 0)),
            pl.BlockSpec((None, None, bq, d), lambda n_, h_, i, m: (n_, h_, i, 0)),
            pl.BlockSpec((None, None, t, d), lambda n_, h_, i, m: (n_, _div(h_, groups), 0, 0)),
            pl.BlockSpec((None, None, t, d), lambda n_, h_, i, m: (n_, _div(h_, groups), 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, d), lambda n_, h_, i, m: (n_, h_, i, 0)),
            pl.BlockSpec((None, None, 1, bq), lambda n_, h_, i, m: (n_, h_, 0, i)),
        ],
        scratch_shapes=[
            pltpu.VMEM((bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, d), jnp.float32),
            pltpu.VMEM((t, d) if _scale_keys(scale, ablate) else (bq, d), q.dtype),
        ],
    )
    o, lse = pl.pallas_call(
        kernel,
        name="flash_forward",
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((n, h, 1, t), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            # In order over a row's heads and tiles: the keys are scaled at a group's first.
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=_forward_vmem_bytes(t, d, bq, bc),
        ),
        interpret=interpret,
    )(mixed, q_seg, kv_seg, q, k, v)
    return o, lse


# ---------------------------------------------------------------------------- backward


def _backward_kernel(
    mixed_ref,  # SMEM int32 [N * T / bq * T / bk]: `_mixed_tiles`
    q_seg_ref,  # [1, T] int32: the row's segment ids
    kv_seg_ref,  # [bk, 128] int32: the keys' segment ids, repeated over the lanes
    q_ref,  # [G, T, D]: the group's queries, the whole row
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    do_ref,  # [G, T, D]
    lse_ref,  # [G, 1, T] float32
    di_ref,  # [G, 1, T] float32: rowsum(o * do)
    dq_ref,  # [G, T, D]: written at the last key tile
    dk_ref,  # [bk, D]
    dv_ref,  # [bk, D]
    dq_acc,  # scratch [G, T, D] float32: dq summed over the key tiles
    dk_acc,  # scratch [bk, D] float32
    dv_acc,  # scratch [bk, D] float32
    k_scaled_ref,  # scratch [bk, D]: k x scale (a power of two), else unused
    *,
    bq: int,
    bk: int,
    scale: float,
    ablate: frozenset[str] = frozenset(),
):
    n_, j = pl.program_id(0), pl.program_id(2)
    k_first = j * bk
    groups, t = q_ref.shape[0], q_ref.shape[1]

    @pl.when(j == 0)
    def _init_dq():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)
    # A power-of-two scale goes on the key tile, once per grid step, instead of on every query
    # chunk (a float32 pass per step): scale·(k·qᵀ) and scale·(ds·k) come out bit for bit the
    # same either way, and dk takes the factor at the end.
    scale_keys = _scale_keys(scale, ablate)
    if scale_keys:
        k_scaled_ref[...] = _scaled(k_ref[...], scale)

    def pair(head, first, segments: bool, on_diagonal: bool, key0=0, keys=bk, row0=0, rows=bq):
        """One step: the tile's keys [key0, key0 + keys) against the queries from
        first + row0 (static sizes)."""
        kr, qr = pl.ds(key0, keys), pl.ds(first + row0, rows)
        if scale_keys:
            q, k = q_ref[head, qr, :], k_scaled_ref[kr, :]
        else:
            q, k = _scaled(q_ref[head, qr, :], scale), k_ref[kr, :]
        v, do = v_ref[kr, :], do_ref[head, qr, :]
        s = _dot(k, q, (1, 1))  # [keys, rows]: keys in sublanes, queries in lanes
        if "no_mask" not in ablate:
            same = None
            if segments:
                same = _lanes(kv_seg_ref[kr, :], rows) == q_seg_ref[:, qr]
            s = _masked(s, same, on_diagonal, first + row0, k_first + key0, query_axis=1)
        lse = lse_ref[head, :, qr]  # [1, rows]
        p = s - lse if "no_exp" in ablate else jnp.exp(s - lse)  # [keys, rows]
        dv_acc[kr, :] += _dot(p.astype(do.dtype), do, (1, 0))
        dp = _dot(v, do, (1, 1))  # [keys, rows]
        ds = (p * (dp - di_ref[head, :, qr])).astype(q.dtype)
        dk_acc[kr, :] += _dot(ds, q, (1, 0))
        if "no_dq" not in ablate:
            dq_acc[head, qr, :] += _dot(ds, k, (0, 0))  # [rows, D]

    def chunk(head, c, on_diagonal: bool):
        first = pl.multiple_of(c * bq, bq)

        def diagonal(segments: bool, offset: int, size: int):
            """The tile's keys [offset, offset + size) against the queries first + the same,
            first == k_first."""
            if not _split_diagonal(size, ablate):
                pair(head, first, segments, True, offset, size, offset, size)
                return
            # The upper right quarter (the last keys, the first queries) is all masked: the
            # first half of the keys against all the queries, then the second half against the
            # second half (split again).
            pair(head, first, segments, True, offset, size // 2, offset, size)
            diagonal(segments, offset + size // 2, size // 2)

        def step(segments: bool):
            if on_diagonal and bq == bk:
                diagonal(segments, 0, bk)
            else:
                pair(head, first, segments, on_diagonal)

        mixed = mixed_ref[(n_ * (t // bq) + c) * pl.num_programs(2) + j]
        pl.when(mixed == 0)(functools.partial(step, False))
        pl.when(mixed != 0)(functools.partial(step, True))

    # The query chunks that see a key of this tile start at the one holding its first key;
    # those whose first query is before the tile's last key need the causal mask.
    start = _div(k_first, bq)
    after = jnp.minimum(_div(k_first + bk - 2, bq) + 1, t // bq)

    def head_loop(head, _):
        jax.lax.fori_loop(start, after, lambda c, _: chunk(head, c, True), None)
        jax.lax.fori_loop(after, t // bq, lambda c, _: chunk(head, c, False), None)

    jax.lax.fori_loop(0, groups, head_loop, None)
    # The gradients of q and k, not of the scaled one the products took.
    dk = dk_acc[...] * scale if scale_keys else dk_acc[...]
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    @pl.when(j == pl.num_programs(2) - 1)
    def _write_dq():
        dq = dq_acc[...] if scale_keys else dq_acc[...] * scale
        dq_ref[...] = dq.astype(dq_ref.dtype)


def _backward(
    q, k, v, seg, o, lse, do, tiles: FlashTiles, interpret: bool, scale=1.0, ablate=frozenset()
):
    """dq, dk, dv. The grid runs over (row, key/value head, key tile of
    ``tiles.bwd_block_kv``); the group's queries, output gradients and row statistics for the
    whole row stay in VMEM, and each key tile loops over the group's query heads and the query
    chunks (``tiles.bwd_block_q``) that see it: dk and dv are summed in VMEM, dq in float32 in
    VMEM across the key tiles, written once in q's dtype. ``ablate``
    (benchmarks/attention_ablation.py): "no_mask", "no_exp", "no_dq", and as the forward's
    "no_split", "split_128", "scale_queries"."""
    n, h, t, d = q.shape
    kv_heads = k.shape[1]
    groups = h // kv_heads
    bq, bk = tiles.bwd_block_q, tiles.bwd_block_kv
    di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)[:, :, None, :]
    kernel = functools.partial(_backward_kernel, bq=bq, bk=bk, scale=scale, ablate=ablate)
    group = lambda n_, g, j, m: (n_, g, 0, 0)  # noqa: E731
    key_tile = lambda n_, g, j, m: (n_, g, j, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(n, kv_heads, t // bk),
        in_specs=[
            pl.BlockSpec((None, 1, t), lambda n_, g, j, m: (n_, 0, 0)),
            pl.BlockSpec((None, bk, _LANES), lambda n_, g, j, m: (n_, j, 0)),
            pl.BlockSpec((None, groups, t, d), group),
            pl.BlockSpec((None, None, bk, d), key_tile),
            pl.BlockSpec((None, None, bk, d), key_tile),
            pl.BlockSpec((None, groups, t, d), group),
            pl.BlockSpec((None, groups, 1, t), group),
            pl.BlockSpec((None, groups, 1, t), group),
        ],
        out_specs=[
            pl.BlockSpec((None, groups, t, d), group),
            pl.BlockSpec((None, None, bk, d), key_tile),
            pl.BlockSpec((None, None, bk, d), key_tile),
        ],
        scratch_shapes=[
            pltpu.VMEM((groups, t, d), jnp.float32),
            pltpu.VMEM((bk, d), jnp.float32),
            pltpu.VMEM((bk, d), jnp.float32),
            pltpu.VMEM((bk, d), k.dtype),
        ],
    )
    dq, dk, dv = pl.pallas_call(
        kernel,
        name="flash_backward",
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=_backward_vmem_bytes(groups, t, d, bq, bk),
        ),
        interpret=interpret,
    )(
        _mixed_tiles(seg, bq, bk),
        seg[:, None, :],
        jnp.broadcast_to(seg[:, :, None], (n, t, _LANES)),
        q,
        k,
        v,
        do,
        lse,
        di,
    )
    return dq, dk, dv


# VMEM, from the blocks (two buffers each), the scratch and room for a step's intermediates;
# rows are laid out 128 lanes wide, [1, T] rows 8 sublanes high.
def _forward_vmem_bytes(t: int, d: int, bq: int, bc: int) -> int:
    lanes = max(d, _LANES)
    blocks = 2 * t * lanes * 2 + 8 * t * 4 + bq * _LANES * 4 + 2 * bq * lanes * 2 + 8 * bq * 4
    scratch = 2 * bq * _LANES * 4 + bq * lanes * 4 + t * lanes * 4
    return 2 * blocks + scratch + 8 * bq * bc * 4 + (4 << 20)


def _backward_vmem_bytes(groups: int, t: int, d: int, bq: int, bk: int) -> int:
    lanes = max(d, _LANES)
    rows = groups * t * lanes * 2  # one [G, T, D] block of bf16
    blocks = 3 * rows + 2 * groups * 8 * t * 4 + 8 * t * 4 + bk * _LANES * 4 + 4 * bk * lanes * 2
    scratch = 2 * rows + 2 * bk * lanes * 4
    return 2 * blocks + scratch + 8 * bk * bq * 4 + (4 << 20)


def vmem_bytes(heads: int, kv_heads: int, t: int, d: int, tiles: FlashTiles) -> int:
    """The VMEM the larger of the two kernels asks for (rows of ``t`` tokens)."""
    return max(
        _forward_vmem_bytes(t, d, tiles.block_q, tiles.block_kv),
        _backward_vmem_bytes(heads // kv_heads, t, d, tiles.bwd_block_q, tiles.bwd_block_kv),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def flash_attention_heads_major(
    q, k, v, segment_ids, tiles: FlashTiles, interpret: bool, scale: float = 1.0
):
    """Causal attention within segments: q [N, H, T, D], k, v [N, K, T, D], segment ids
    int [N, T] -> softmax(scale q kᵀ) v [N, H, T, D] in q's dtype (see the module's
    docstring). The kernels scale q (in float32, rounded once to its dtype)."""
    return _forward(q, k, v, segment_ids, tiles, interpret, scale)[0]


def _vjp_forward(q, k, v, segment_ids, tiles, interpret, scale):
    o, lse = _forward(q, k, v, segment_ids, tiles, interpret, scale)
    return o, (q, k, v, segment_ids, o, lse)


def _vjp_backward(tiles, interpret, scale, residuals, do):
    q, k, v, segment_ids, o, lse = residuals
    dq, dk, dv = _backward(q, k, v, segment_ids, o, lse, do, tiles, interpret, scale)
    return dq, dk, dv, None


flash_attention_heads_major.defvjp(_vjp_forward, _vjp_backward)
