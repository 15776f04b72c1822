"""rewardax's attention rule (`transformer.attention_mask`) through JAX's Pallas splash attention
kernel (TPU).

`jax.experimental.pallas.ops.tpu.splash_attention` runs flash attention tile by tile and skips
the tiles its mask rules out: for causal rows of T tokens, about half of the [T, T] score matrix.
It takes grouped-query attention as it is (query head h reads key/value head h // G, the head
order of `transformer.Attention`), so k and v are not repeated to every query head.

Two masks, by layout:
- padded and packed rows: a static causal mask and the segment ids (a query sees the keys of its
  own segment). The kernel's mask tables are built once, at trace time.
- the shared-prompt tree (branch ids) and sliding windows: segment equality cannot say "the
  prompt is seen by every branch", so each row's [T, T] mask is built on the device from its ids
  and given to the kernel as a dynamic mask (`_row_mask`): a bool [T, T] per row (4 MiB at 2048
  tokens), of which the kernel reads only the tiles that are neither all-True nor all-False, and
  skips the all-False ones (on the tree, a branch's tiles against its siblings').
In both, rewardax's segment 0 (padding) sees padding: those queries' outputs are zeroed
afterwards, as `transformer.attend` gives a padding query zeros, and no query row is empty.

Example (Qwen2.5-0.5B heads, 14 query and 2 key/value heads of 64)::

    q = jnp.zeros((8, 2048, 14, 64), jnp.bfloat16); k = v = jnp.zeros((8, 2048, 2, 64), jnp.bfloat16)
    out = splash_attention(q, k, v, segment_ids, scale=0.125)  # [8, 2048, 14, 64] bfloat16
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from rewardax.models.flash_attention import FlashTiles, flash_attention_heads_major, vmem_bytes
from rewardax.models.kernels import ATTENTION_RESIDUALS, SPLASH_BLOCK, traced_under
from rewardax.sharding import LOGICAL_AXIS_RULES

# The kernel's lane width: tiles must be multiples of it.
_LANES = 128


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _fit(tile: int, length: int) -> int:
    """A tile for rows of ``length`` tokens: the tile, or the lane-rounded length if shorter."""
    return min(tile, _round_up(length, _LANES))


# Flash tiles larger than this are halved for rows they would pad more (`flash_tiles`).
_FLASH_TILE_FLOOR = 512


def flash_tiles(tiles: FlashTiles | tuple[int, ...], length: int) -> FlashTiles:
    """Flash tiles for rows of ``length`` tokens: each shrunk to a short row (`_fit`), and one
    over 512 halved while the half pads the row less (rows of 1536 tokens get 512s, not 1024s
    and 512 tokens of padding)."""

    def fit(tile: int) -> int:
        tile = _fit(tile, length)
        while tile > _FLASH_TILE_FLOOR and (tile // 2) % _LANES == 0:
            if _round_up(length, tile // 2) >= _round_up(length, tile):
                break
            tile //= 2
        return tile

    return FlashTiles(*(fit(b) for b in tiles))


def splash_block_sizes(
    length: int,
    block_q: int,
    block_kv: int,
    fused_backward: bool,
    *,
    block_kv_compute: int | None = None,
    bwd_block_q: int | None = None,
    bwd_block_kv: int | None = None,
) -> splash.BlockSizes:
    """Tiles for rows of ``length`` tokens: the requested ones, each shrunk to the
    (lane-rounded) length for short rows. The backward kernels take ``bwd_block_q`` x
    ``bwd_block_kv`` (None: the forward's tiles); ``block_kv_compute`` keys per step inside a
    key tile (None: the whole tile)."""
    bwd_block_q = block_q if bwd_block_q is None else bwd_block_q
    bwd_block_kv = block_kv if bwd_block_kv is None else bwd_block_kv
    block_kv_compute = block_kv if block_kv_compute is None else block_kv_compute
    tiles = (block_q, block_kv, block_kv_compute, bwd_block_q, bwd_block_kv)
    if any(b % _LANES for b in tiles):
        raise ValueError(f"splash tiles must be multiples of {_LANES}, got {tiles}")
    if block_kv % block_kv_compute:
        raise ValueError(f"block_kv_compute={block_kv_compute} must divide block_kv={block_kv}")
    fit = lambda b: _fit(b, length)  # noqa: E731
    bkv = fit(block_kv)
    bkv_compute = bkv if bkv % fit(block_kv_compute) else fit(block_kv_compute)
    backward = {
        "block_q_dkv": fit(bwd_block_q),
        "block_kv_dkv": fit(bwd_block_kv),
        "block_kv_dkv_compute": fit(bwd_block_kv),
    }
    if not fused_backward:
        backward |= {"block_q_dq": fit(bwd_block_q), "block_kv_dq": fit(bwd_block_kv)}
    return splash.BlockSizes(
        block_q=fit(block_q),
        block_kv=bkv,
        block_kv_compute=bkv_compute,
        use_fused_bwd_kernel=fused_backward,
        **backward,
    )


def _per_shard(kernel, heads: int, kv_heads: int):
    """``kernel(q, k, v, ids)`` as is on one device; on a mesh (the context's,
    `sharding.traced_in_mesh`) run per shard under ``shard_map``, since XLA cannot partition a
    Mosaic kernel: rows (and ``ids`` [N, ..., T]) split over the data-parallel axes as the batch
    is, heads over ``tp`` when both head counts divide by it (else every ``tp`` device computes
    all heads of its rows)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel
    batch = LOGICAL_AXIS_RULES["batch"]
    tp = mesh.shape.get("tp", 1)
    head_axis = "tp" if tp > 1 and heads % tp == 0 and kv_heads % tp == 0 else None
    qkv = PartitionSpec(batch, head_axis, None, None)
    return jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, PartitionSpec(batch)),
        out_specs=qkv,
        check_vma=False,
    )


def _row_mask(ids: jax.Array, sliding_window: int | None) -> jax.Array:
    """bool [1, T, T] for one row of ids [3, T] (segment, branch, position): query i sees key j
    iff j <= i, same segment, the key's branch is 0 or the query's, and (with a window) their
    positions differ by less than ``sliding_window``: `transformer.attention_mask`, except that
    padding (segment 0) sees padding."""
    segment, branch, position = ids[0], ids[1], ids[2]
    t = segment.shape[0]
    seen = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    seen &= segment[:, None] == segment[None, :]
    seen &= (branch[None, :] == 0) | (branch[None, :] == branch[:, None])
    if sliding_window is not None:
        seen &= position[:, None] - position[None, :] < sliding_window
    return seen[None]


def _dynamic_mask_kernel(
    mask: jax.Array, sizes: splash.BlockSizes, interpret: bool
) -> splash.SplashAttentionKernel:
    """The splash kernel for a mask computed on the device (bool [1, T, T]: every head's)."""
    kernel = splash.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    # make_splash_mha turns every field of its mask tables into an array, the flag that says the
    # mask is dynamic too: traced here, and `SplashAttentionKernel.__call__` branches on it in
    # Python (only to name a scope). The tables themselves are complete without it.
    for field in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
        info = getattr(kernel, field)
        if info is not None:
            setattr(kernel, field, info._replace(is_dynamic_mask=None))
    return kernel


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    scale: float,
    *,
    block_q: int = SPLASH_BLOCK,
    block_kv: int = SPLASH_BLOCK,
    fused_backward: bool = False,
    interpret: bool = False,
    block_kv_compute: int | None = None,
    bwd_block_q: int | None = None,
    bwd_block_kv: int | None = None,
    dense_residuals: bool = False,
    flash: FlashTiles | None = None,
    branch_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal softmax attention within segments (and branches, and a window).

    Args:
      q: [N, T, H, D] queries; k, v: [N, T, K, D] with H a multiple of K (grouped queries).
        The products run in q's dtype with float32 accumulation and softmax.
      segment_ids: int [N, T]; a query sees the keys at or before it with its segment id;
        0 marks padding (its queries get zeros).
      scale: the logits' factor (1/sqrt(D)), applied to q before the kernel.
      branch_ids: int [N, T] or None: a key of branch b > 0 is seen only by queries of branch b,
        branch 0 (a shared prompt) by every branch (`data.packing.pack_groups`).
      positions, sliding_window: with a window, a query sees only keys whose position is less
        than ``sliding_window`` before its own (positions int [N, T] required). A window of at
        least T tokens is taken to rule nothing out: positions that advance by at most one per
        token, as every rewardax layout's do.
      block_q, block_kv: the kernel's tiles (multiples of 128); rows are padded to a multiple
        of both.
      fused_backward: one backward kernel for dq, dk and dv instead of two.
      block_kv_compute, bwd_block_q, bwd_block_kv: see `splash_block_sizes`.
      interpret: run in Pallas' interpret mode (CPU tests).
      dense_residuals: what remat keeps of the kernel in 128-wide rows (`Kernels`).
      flash: tiles (`flash_attention.FlashTiles`, fitted to the row by `flash_tiles`):
        causal attention within segments runs rewardax's own kernels (`flash_attention`) with
        them, and the block_* and fused_backward arguments are unused; None: splash. On a TPU
        the kernels hold whole rows in VMEM (`flash_attention.vmem_bytes`; with 7 query heads
        per key/value head a v5e's 128 MiB hold ~6,000 tokens at tiles of 1024, ~7,900 at
        512): longer rows take tiles of 512, then splash. The branch mask, sliding windows and
        heads wider than 128 run splash whatever this says.

    Returns:
      [N, T, H, D] in q's dtype. float32 inputs run float32 products (the kernel's forward and
      backward traced at "highest" matmul precision), bf16 inputs bf16 products whatever the
      caller's precision setting (the kernel cannot take bf16 operands at float32 precision).
    """
    _, t, h, _ = q.shape
    sizes = splash_block_sizes(
        t,
        block_q,
        block_kv,
        fused_backward,
        block_kv_compute=block_kv_compute,
        bwd_block_q=bwd_block_q,
        bwd_block_kv=bwd_block_kv,
    )
    if sliding_window is not None and sliding_window >= t:
        # Positions in a row differ by less than its length (they never advance faster than
        # the index), so such a window rules nothing out.
        sliding_window = None
    if sliding_window is not None and positions is None:
        raise ValueError("a sliding window needs the tokens' positions")
    tree = branch_ids is not None or sliding_window is not None
    # Flash takes heads of up to 128 (one lane row); wider ones, and the dynamic masks, run splash.
    if flash is not None and not tree and q.shape[-1] <= _LANES:
        flash = flash_tiles(flash, t)
    else:
        flash = None
    if flash is not None and not interpret and jax.default_backend() == "tpu":
        # The kernels hold whole rows in VMEM: rows too long for the tiles asked take tiles of
        # 512 (their steps need less), then splash.
        capacity = pltpu.get_tpu_info().vmem_capacity_bytes
        smaller = flash_tiles(tuple(min(b, _FLASH_TILE_FLOOR) for b in flash), t)
        flash = next(
            (
                tiles
                for tiles in (flash, smaller)
                if vmem_bytes(h, k.shape[2], _round_up(t, math.lcm(*tiles)), q.shape[-1], tiles)
                <= capacity
            ),
            None,
        )
    if flash is None:
        tiles = (sizes.block_q, sizes.block_kv, sizes.block_q_dkv, sizes.block_kv_dkv)
        # Scaled in float32 then rounded once; exact for head widths of 4**i (1/8 for 64).
        q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    else:
        tiles = flash  # the flash kernels scale q themselves, the same way
    t_pad = _round_up(t, math.lcm(*tiles))
    # ids [N, T] (segments), or [N, 3, T] (segments, branches, positions) for a dynamic mask.
    ids = segment_ids.astype(jnp.int32)
    if tree:
        zeros = jnp.zeros_like(ids)
        ids = jnp.stack(
            [
                ids,
                zeros if branch_ids is None else branch_ids.astype(jnp.int32),
                zeros if positions is None else positions.astype(jnp.int32),
            ],
            axis=1,
        )
    if t_pad != t:
        # The tail is padding (segment 0): no real query sees it, its outputs are cut off.
        widths = ((0, 0), (0, t_pad - t), (0, 0), (0, 0))
        q, k, v = (jnp.pad(a, widths) for a in (q, k, v))
        ids = jnp.pad(ids, [(0, 0)] * (ids.ndim - 1) + [(0, t_pad - t)])

    def rows(q, k, v, ids):  # [N, H, T, D], [N, K, T, D], [N, K, T, D], [N, (3,) T]
        # The kernel (its mask tables are arrays) is made here, inside `traced_under`'s trace:
        # a custom_vjp function must not close over arrays of the trace around it. Under
        # shard_map, q holds this device's heads.
        if tree:

            def one_tree_row(q_row, k_row, v_row, ids_row):  # ids_row [3, T]
                kernel = _dynamic_mask_kernel(_row_mask(ids_row, sliding_window), sizes, interpret)
                return kernel(q_row, k_row, v_row)

            return jax.vmap(one_tree_row)(q, k, v, ids)
        if flash is not None:
            return flash_attention_heads_major(q, k, v, ids, flash, interpret, scale)
        heads = q.shape[1]
        mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t_pad, t_pad))] * heads)
        kernel = splash.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )

        def one_row(q_row, k_row, v_row, seg_row):  # [H, T, D], [K, T, D], [K, T, D], [T]
            return kernel(q_row, k_row, v_row, splash.SegmentIds(q=seg_row, kv=seg_row))

        return jax.vmap(one_row)(q, k, v, ids)

    heads_major = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731  [N, T, *, D] -> [N, *, T, D]
    precision = "highest" if q.dtype == jnp.float32 else "default"
    kept = traced_under(precision, rows, ATTENTION_RESIDUALS, dense=dense_residuals)
    out = _per_shard(kept, h, k.shape[2])(heads_major(q), heads_major(k), heads_major(v), ids)
    out = heads_major(out)[:, :t]
    return jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros_like(out))
