"""Flax NNX decoder backbone for the Llama family, Mistral, Qwen2 and Qwen3.

Shapes: N = rows, T = tokens per row, E = hidden size, H = query heads, K = key/value heads,
D = head width, M = MLP width, V = vocabulary.

Parameters carry *logical* axis names (``vocab``, ``embed``, ``mlp``, ``heads``, ``kv_heads``,
``head_dim``, ``norm`` for norm scales, ``labels`` for the score head's output) as ``out_sharding`` metadata with eager sharding off, so a model can be built on the
host without a mesh; ``rewardax.sharding`` maps the names to mesh axes in one table.

Kernels are stored ``[in, out]`` with the head axes split out (``q_proj.kernel`` is ``[E, H, D]``),
so a tensor-parallel split of the heads is one logical name; ``models.hf`` reshapes to and from
Hugging Face's ``[out, in]`` matrices.

Over 500 lines: the CPU formulation's written backwards (`mixed_matmuls`, `attend`) sit next to
the layers that call them, each with the measurement that justifies it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from rewardax.errors import ConfigError
from rewardax.models.config import ModelConfig
from rewardax.models.kernels import (
    ATTENTION_OUTPUT,
    ATTENTION_RESIDUALS,
    MLP_PROJECTIONS,
    Kernels,
    select_kernels,
    xla_attention,
)

REMAT_POLICIES = (
    "none",
    "full",
    "save_dots",
    "save_attention",
    "save_attention_mlp",
    "offload_attention",
)

# Today's XLA:CPU formulation, the default of the layers when called without a choice.
# The formulation of a layer called without one (its float32 products as traced). Built for the
# "cpu" backend by name: asking JAX for the backend here would start it at import, before
# rewardax.hostmem can apply (tests/test_hostmem.py).
_CPU_KERNELS = select_kernels("cpu", "cpu")


def _param(
    rngs: nnx.Rngs | None,
    shape: Sequence[int],
    names: tuple[str, ...],
    param_dtype: Any,
    std: float | None,
) -> nnx.Param:
    """A parameter with logical axis names; ``std=None`` means ones (norm scales)."""
    if std is None:
        value = jnp.ones(shape, param_dtype)
    elif std == 0.0 or rngs is None:
        value = jnp.zeros(shape, param_dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, param_dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32, rounded to x's dtype and scaled by the weight
    in x's dtype (as HF does). With `Kernels.float32_sums` the product of the two rounded factors
    is taken in float32 and rounded once: the same values as a product in x's dtype, but the
    weight's gradient, a sum over every token, is summed in float32. XLA:CPU summed a bf16
    product's gradient in bf16 (16384 tokens: up to 2.1% off, benchmarks/bf16_gradient_sums.py)."""

    def __init__(self, dim: int, eps: float, *, names: tuple[str, ...], param_dtype: Any):
        self.weight = _param(None, (dim,), names, param_dtype, std=None)
        self.eps = eps

    def __call__(self, x: jax.Array, kernels: Kernels | None = None) -> jax.Array:
        """x: [..., dim] -> [..., dim] in x's dtype; ``kernels``: None = `select_kernels("cpu")`'s."""
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        weight, normed = self.weight[...].astype(x.dtype), normed.astype(x.dtype)
        if not (kernels or _CPU_KERNELS).float32_sums:
            return weight * normed
        return (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(x.dtype)


class Projection(nnx.Module):
    """``y = x @ kernel (+ bias)`` contracting the leading ``len(in_shape)`` kernel axes.

    ``matmul_dtype`` (None = the activations' dtype) is the dtype the matmul's two inputs are cast
    to; products accumulate and come out in float32, then in x's dtype. bfloat16 here with float32
    activations is the usual mixed precision: about 2x faster matmuls on a CPU with AMX
    (benchmarks/bench_matmul_dtype.py), and the usual choice on GPUs and TPUs; everything else
    stays float32.
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        names: tuple[str, ...],
        *,
        use_bias: bool,
        std: float,
        param_dtype: Any,
        rngs: nnx.Rngs,
        matmul_dtype: Any = None,
    ):
        self.n_in = len(in_shape)
        self.matmul_dtype = None if matmul_dtype is None else jnp.dtype(matmul_dtype)
        self.kernel = _param(rngs, (*in_shape, *out_shape), names, param_dtype, std)
        self.bias = (
            _param(None, out_shape, names[self.n_in :], param_dtype, 0.0) if use_bias else None
        )

    def __call__(self, x: jax.Array, kernels: Kernels | None = None) -> jax.Array:
        """x: [..., *in_shape] -> [..., *out_shape] in x's dtype; see `project`."""
        return project(x, (self,), kernels)[0]


def project(
    x: jax.Array, projections: Sequence[Projection], kernels: Kernels | None = None
) -> tuple[jax.Array, ...]:
    """``p(x)`` for each projection p of the same input x (q/k/v, or gate/up), same contracted
    shape and matmul dtype. With bf16 matmuls, x is cast and kept for the backward pass once for
    all of them, and its transpose for the weight gradients is made once: three separate calls
    stored three bf16 copies of the q/k/v input per layer (seen in the compiled HLO of a SmolLM2
    step, where the scan stacks each copy into a [layers, rows, hidden] buffer).

    ``kernels`` (None = `select_kernels("cpu")`'s): without
    `Kernels.written_projection_backward` (off the CPU) the mixed-precision matmuls are plain
    casts and dots differentiated by autodiff: the written backward and its physical transpose
    are XLA:CPU tricks, slower on a TPU (issue 28). Biases are added as `add_bias` says."""
    kernels = kernels or _CPU_KERNELS
    first = projections[0]
    n_in, matmul_dtype = first.n_in, first.matmul_dtype
    weights = [p.kernel[...] for p in projections]
    lead, contracted = x.shape[: x.ndim - n_in], weights[0].shape[:n_in]
    # One 2-D matmul [rows, in] @ [in, out]: contracting over the row axes N and T at once in
    # the backward pass (dW = x^T dy) made XLA:CPU copy dy transposed in every layer, 20% of
    # a SmolLM2 gradient step (benchmarks/README.md); the reshapes are free.
    x2 = x.reshape(-1, math.prod(contracted))
    weights2 = tuple(k.reshape(x2.shape[1], -1) for k in weights)
    if matmul_dtype is None or matmul_dtype == x.dtype:
        ys = tuple(jnp.dot(x2, k.astype(x.dtype)) for k in weights2)
    elif kernels.written_projection_backward:
        ys = mixed_matmuls(x2, weights2, matmul_dtype)
    else:
        xc = x2.astype(matmul_dtype)
        ys = tuple(
            jnp.dot(xc, k.astype(matmul_dtype), preferred_element_type=jnp.float32).astype(x.dtype)
            for k in weights2
        )
    out = []
    for p, k, y in zip(projections, weights, ys, strict=True):
        if getattr(p, "lora_a", None) is not None:  # `models.lora`: + (alpha / r) x A B
            a = p.lora_a[...].reshape(x2.shape[1], -1).astype(x2.dtype)
            b = p.lora_b[...]
            b = b.reshape(b.shape[0], -1).astype(x2.dtype)
            y = y + (jnp.dot(jnp.dot(x2, a), b) * p.lora_scale).astype(y.dtype)
        y = y.reshape(*lead, *k.shape[n_in:])
        if p.bias is not None:
            y = add_bias(y, p.bias[...], kernels.float32_sums)
        out.append(y)
    return tuple(out)


def add_bias(y: jax.Array, bias: jax.Array, in_float32: bool = True) -> jax.Array:
    """``y + bias`` in y's dtype, the bias rounded to y's dtype. ``in_float32``
    (`Kernels.float32_sums`): added in float32 and rounded once, the same values, but the bias's
    gradient, a sum over every token, is then summed in float32 and rounded once to the bias's
    copy (XLA:CPU summed a bf16 add's gradient in bf16: up to 1.8% off)."""
    if not in_float32:
        return y + bias.astype(y.dtype)
    return (y.astype(jnp.float32) + bias.astype(y.dtype).astype(jnp.float32)).astype(y.dtype)


def _physical_transpose(a: jax.Array) -> jax.Array | None:
    """[M, K] -> [K, M] as a real copy, or None when K is odd.

    A plain transpose feeding a dot is folded into the dot's dimension numbers, and XLA:CPU runs
    a bfloat16 dot contracting both operands' first axes (the weight gradient x^T dy) upcast to
    float32 through Eigen: 2.4-3.6x slower than the YNNPACK kernel it uses for [M, K] @ [K, N]
    (benchmarks/README.md). Going through [M, K/2, 2] hides the transpose from that rewrite; the
    copy costs one pass over x.
    """
    m, k = a.shape
    if k % 2:
        return None
    return a.reshape(m, k // 2, 2).transpose(1, 2, 0).reshape(k, m)


def mixed_matmul(x: jax.Array, kernel: jax.Array, matmul_dtype: Any) -> jax.Array:
    """``x @ kernel`` with both inputs cast to ``matmul_dtype``, float32 accumulation; x [M, K],
    kernel [K, N] -> [M, N] in x's dtype. The gradients come out in x's and kernel's dtypes."""
    return mixed_matmuls(x, (kernel,), matmul_dtype)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def mixed_matmuls(
    x: jax.Array, kernels: tuple[jax.Array, ...], matmul_dtype: Any
) -> tuple[jax.Array, ...]:
    """``x @ k`` for each kernel k [K, N_i] as in `mixed_matmul`, keeping one cast copy of x."""
    return _mixed_forward(x, kernels, matmul_dtype)[0]


def _mixed_forward(x: jax.Array, kernels: tuple[jax.Array, ...], matmul_dtype: Any):
    xc = x.astype(matmul_dtype)
    ys = tuple(
        jnp.dot(xc, k.astype(matmul_dtype), preferred_element_type=jnp.float32).astype(x.dtype)
        for k in kernels
    )
    # The backward pass needs x only as x^T (the weight gradients), so that is what is kept:
    # made here, it is written once into the scan's stacked residuals, where keeping xc and
    # transposing it in the backward pass wrote it twice and read it back once more.
    # The kernels themselves are kept, not their cast copies: inside the layer scan a residual
    # that is a slice of the stacked parameters is read in place, a new array would be stacked
    # per layer.
    xt = _physical_transpose(xc)
    return ys, (xc if xt is None else xt, kernels)


def _mixed_backward(matmul_dtype: Any, residuals, grad_ys: tuple[jax.Array, ...]):
    saved, kernels = residuals
    # x^T, or x itself when its width K is odd (no physical transpose then).
    xc, xt = (saved, None) if kernels[0].shape[0] % 2 else (None, saved)
    f32 = jnp.float32
    grad_x, grad_ks = None, []
    for k, grad_y in zip(kernels, grad_ys, strict=True):
        g = grad_y.astype(matmul_dtype)
        gx = jax.lax.dot_general(
            g, k.astype(matmul_dtype), (((1,), (1,)), ((), ())), preferred_element_type=f32
        )
        grad_x = gx if grad_x is None else grad_x + gx
        if xt is None:
            gk = jax.lax.dot_general(xc, g, (((0,), (0,)), ((), ())), preferred_element_type=f32)
        else:
            gk = jnp.dot(xt, g, preferred_element_type=f32)
        grad_ks.append(gk.astype(k.dtype))
    return grad_x.astype(grad_ys[0].dtype), tuple(grad_ks)


mixed_matmuls.defvjp(_mixed_forward, _mixed_backward)


def rope_inverse_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [D/2] (float32) and the cos/sin scale for the config's RoPE variant.

    ``llama3`` scaling follows the Llama 3.1 release: wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, shorter than
    ``... / high_freq_factor`` kept, and the band between interpolated smoothly.
    """
    dim = config.resolved_head_dim
    # Base frequencies rounded like HF (float32 power of float32 exponents), then scaled in float64.
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / np.float32(config.rope_theta) ** exponents).astype(np.float64)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_ctx / low
        high_freq_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32), 1.0


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, scale: float
) -> tuple[jax.Array, jax.Array]:
    """positions int [N, T] -> (cos, sin) float32 [N, T, D] in the rotate-half layout."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(
    x: jax.Array, cos: jax.Array, sin: jax.Array, rotation_matmul: bool = False
) -> jax.Array:
    """x: [N, T, heads, D]; cos/sin [N, T, D]. Rotated in float32, returned in x's dtype.

    The rotated half (``[-x2, x1]`` for x = ``[x1, x2]``) is two slices and a concatenation, or
    with ``rotation_matmul`` (`Kernels.rope_matmul`) the product of x with a [D, D] matrix of
    0 and +-1: the same values (each output is one input, exactly, at the highest precision),
    without arrays of half a head's width. XLA:TPU lays those out in 128-wide tiles (a quarter
    full for head_dim 64) and wrote them to memory around the rotation, forward and backward:
    9-12% of a Qwen2.5-0.5B or SmolLM2 step on a v5e (benchmarks/README.md, 2026-12-07).
    """
    x32 = x.astype(jnp.float32)
    d = x.shape[-1]
    half = d // 2
    if rotation_matmul:
        rotated = jnp.einsum(
            "nthd,de->nthe",
            x,
            jnp.asarray(_rotate_half_matrix(d), x.dtype),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
    else:
        rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


@functools.lru_cache(maxsize=8)
def _rotate_half_matrix(d: int) -> np.ndarray:
    """R [D, D] with ``x @ R == concatenate([-x[D/2:], x[:D/2]])`` for x [D]."""
    half = d // 2
    r = np.zeros((d, d), np.float32)
    r[np.arange(half, d), np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half, d)] = 1.0
    return r


def attention_mask(
    segment_ids: jax.Array,
    positions: jax.Array,
    branch_ids: jax.Array | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Which key each query may attend to: bool [N, T(query), T(key)].

    Query i sees key j iff j <= i (index in the row), ``segment_ids[i] == segment_ids[j] != 0``,
    ``branch_ids[j]`` is 0 (shared prompt) or equal to ``branch_ids[i]``, and, with a sliding
    window, ``positions[i] - positions[j] < sliding_window``. One rule covers padding (segment 0),
    packed rows (several segments) and a shared prompt with K responses (branches 1..K, any K:
    `data.packing.pack_groups`).
    """
    t = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None]
    same_segment = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (
        segment_ids[:, :, None] != 0
    )
    mask = causal & same_segment
    if branch_ids is not None:
        key_branch = branch_ids[:, None, :]
        mask = mask & ((key_branch == 0) | (key_branch == branch_ids[:, :, None]))
    if sliding_window is not None:
        mask = mask & (positions[:, :, None] - positions[:, None, :] < sliding_window)
    return mask


class SplashIds(NamedTuple):
    """What the splash kernel builds `attention_mask`'s rule from (`Attention` with
    ``kernels.attention == "splash"``): int [N, T] each; ``branch_ids`` for a shared prompt,
    ``positions`` for a model with a sliding window, else None."""

    segment_ids: jax.Array
    branch_ids: jax.Array | None = None
    positions: jax.Array | None = None


# Rows longer than this many tokens are attended in query blocks of at most this size.
ATTENTION_QUERY_BLOCK = 256


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Softmax attention, heads-major: q [N, K, G, Tq, D], k/v [N, K, S, D], mask bool [N, Tq, S]
    -> float32 [N, K, G, Tq, D].

    Scores, softmax and the products' sums are float32 whatever the inputs' dtype: bf16 logits
    lose the small differences between keys that attention depends on. The probabilities (and
    the scores' gradient) are rounded to the inputs' dtype for the products that read them, as
    flash attention does under bf16. A query that may see no key (padding) gets zeros.

    The backward pass is written out (`_attend_backward`): it keeps the unnormalised
    probabilities and the row sums' inverses, takes rowsum(dP * P) from the small [Tq, D]
    output, and needs no mask select, where autodiff of the same forward code makes several more
    passes over the [Tq, S] arrays (`benchmarks/bench_attention.py --backward`).
    """
    return _attend_forward(q, k, v, mask, scale)[0]


def _attend_forward(q, k, v, mask, scale):
    scores = jnp.einsum("nkgtd,nksd->nkgts", q, k, preferred_element_type=jnp.float32)
    visible = mask[:, None, None]
    row_max = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    # Unnormalised probabilities (each <= 1): the output, and the backward's dv, divide the small
    # [Tq, D] side by the row sums instead of the [Tq, S] side.
    probs = jnp.where(visible, jnp.exp((scores - row_max) * scale), 0.0)
    total = jnp.sum(probs, axis=-1)
    inv_total = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    # The probabilities are kept in the products' input dtype (bf16 under bf16 matmuls): the
    # products read them in it anyway, and the [Tq, S] residual is then half the size.
    probs = probs.astype(v.dtype)
    out = jnp.einsum("nkgts,nksd->nkgtd", probs, v, preferred_element_type=jnp.float32)
    out = out * inv_total[..., None]
    return out, (q, k, v, probs, inv_total, out)


def _attend_backward(scale, residuals, grad_out):
    q, k, v, probs, inv_total, out = residuals
    grad_out = grad_out.astype(jnp.float32)
    # d(scores) = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O): a [Tq, D] sum.
    row_dot = jnp.sum(grad_out * out, axis=-1)
    grad_probs = jnp.einsum(
        "nkgtd,nksd->nkgts", grad_out.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    grad_scores = probs * ((grad_probs - row_dot[..., None]) * (inv_total * scale)[..., None])
    grad_scores = grad_scores.astype(q.dtype)
    grad_q = jnp.einsum("nkgts,nksd->nkgtd", grad_scores, k, preferred_element_type=jnp.float32)
    grad_k = _contract_queries(q, grad_scores)
    grad_v = _contract_queries((grad_out * inv_total[..., None]).astype(v.dtype), probs)
    return grad_q.astype(q.dtype), grad_k.astype(k.dtype), grad_v.astype(v.dtype), None


def _contract_queries(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [N, K, G, Tq, D], b [N, K, G, Tq, S] -> float32 [N, K, S, D]: the sum over the query
    groups and queries of a^T b, the form of grad_k and grad_v.

    XLA:CPU hands a matmul to its fast library (YNNPACK) only when the left operand's contracted
    axis is its innermost one. Written directly, the contraction over Tq takes [Tq, S] as the left
    operand: XLA transposes it, or runs a slower matmul, for a [Tq, S] array per head. Here the
    small [Tq, D] side is transposed instead, to [D, (G, Tq)], and the product is [D, S]; the
    optimization barriers keep XLA from folding the two small transposes back into the product.
    """
    n, kv, g, t, d = a.shape
    a_t = jax.lax.optimization_barrier(a.transpose(0, 1, 4, 2, 3).reshape(n, kv, d, g * t))
    b = b.reshape(n, kv, g * t, b.shape[-1])
    out_t = jnp.einsum("nkdt,nkts->nkds", a_t, b, preferred_element_type=jnp.float32)
    return jax.lax.optimization_barrier(out_t).transpose(0, 1, 3, 2)


attend.defvjp(_attend_forward, _attend_backward)


def blocked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float,
    matmul_dtype: Any,
    out_dtype: Any,
) -> jax.Array:
    """XLA:CPU's attention: `attend` on query blocks of at most `ATTENTION_QUERY_BLOCK`.

    q [N, T, H, D], k/v [N, T, K, D], mask bool [N, T, T] -> [N, T, H, D] in ``out_dtype``;
    the products' inputs are cast to ``matmul_dtype``.
    """
    n, t, h, d = q.shape
    kv = k.shape[2]
    # Heads-major for the attention products: q [N, K, G, T, D], k/v [N, K, T, D].
    q = q.reshape(n, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    # Query blocks attend only to the keys at or before their last query (the mask is causal
    # in every layout), so long rows skip most of the upper triangle of the score matrix and
    # never hold the whole [T, T] scores at once. Exact: the skipped keys are masked anyway.
    n_blocks = -(-t // ATTENTION_QUERY_BLOCK)
    bounds = [t * i // n_blocks for i in range(n_blocks + 1)]
    # Under bf16 matmuls each block's inputs are cast after slicing: the blocks' gradients
    # for the shared keys and values are then added in float32.
    blocks = [
        attend(
            q[:, :, :, a:b].astype(matmul_dtype),
            k[:, :, :b].astype(matmul_dtype),
            v[:, :, :b].astype(matmul_dtype),
            mask[:, a:b, :b],
            scale,
        )
        for a, b in itertools.pairwise(bounds)
    ]
    out = blocks[0] if n_blocks == 1 else jnp.concatenate(blocks, axis=3)
    return out.astype(out_dtype).transpose(0, 3, 1, 2, 4).reshape(n, t, h, -1)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v bias (Qwen2), q/k norm (Qwen3)."""

    def __init__(
        self, config: ModelConfig, *, param_dtype: Any, rngs: nnx.Rngs, matmul_dtype: Any = None
    ):
        e, h, k, d = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.resolved_head_dim,
        )
        std = config.initializer_range
        kw: dict[str, Any] = {
            "param_dtype": param_dtype,
            "rngs": rngs,
            "std": std,
            "matmul_dtype": matmul_dtype,
        }
        bias = bool(config.attention_bias)
        self.q_proj = Projection((e,), (h, d), ("embed", "heads", "head_dim"), use_bias=bias, **kw)
        self.k_proj = Projection(
            (e,), (k, d), ("embed", "kv_heads", "head_dim"), use_bias=bias, **kw
        )
        self.v_proj = Projection(
            (e,), (k, d), ("embed", "kv_heads", "head_dim"), use_bias=bias, **kw
        )
        self.o_proj = Projection((h, d), (e,), ("heads", "head_dim", "embed"), use_bias=False, **kw)
        if config.qk_norm:
            self.q_norm = RMSNorm(
                d, config.rms_norm_eps, names=("head_dim",), param_dtype=param_dtype
            )
            self.k_norm = RMSNorm(
                d, config.rms_norm_eps, names=("head_dim",), param_dtype=param_dtype
            )
        else:
            self.q_norm = None
            self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, d
        self.sliding_window = config.sliding_window

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, kernels: Kernels
    ) -> jax.Array:
        """x [N, T, E]; cos/sin [N, T, D] -> [N, T, E] in x's dtype.

        ``mask``: bool [N, T, T] (`attention_mask`), or for ``kernels.attention == "splash"``
        the `SplashIds` the kernel builds the same rule from.
        """
        n, t, _ = x.shape
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), kernels)  # [N,T,H|K,D]
        if self.q_norm is not None:
            q, k = self.q_norm(q, kernels), self.k_norm(k, kernels)
        by_matmul = kernels.rope_matmul
        q, k = apply_rope(q, cos, sin, by_matmul), apply_rope(k, cos, sin, by_matmul)
        groups = self.num_heads // self.num_kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        md = q.dtype if self.q_proj.matmul_dtype is None else self.q_proj.matmul_dtype
        if kernels.attention == "splash":
            from rewardax.models.pallas_attention import splash_attention  # imports Pallas

            out = splash_attention(
                q.astype(md),
                k.astype(md),
                v.astype(md),
                mask.segment_ids,
                scale,
                block_q=kernels.block_q,
                block_kv=kernels.block_kv,
                fused_backward=kernels.fused_backward,
                interpret=kernels.interpret,
                block_kv_compute=kernels.block_kv_compute,
                bwd_block_q=kernels.bwd_block_q,
                bwd_block_kv=kernels.bwd_block_kv,
                dense_residuals=kernels.dense_residuals,
                flash=kernels.flash,
                branch_ids=mask.branch_ids,
                positions=mask.positions,
                sliding_window=self.sliding_window,
            )
            return self.o_proj(out.astype(x.dtype), kernels)
        if kernels.attention == "xla":
            q5 = q.reshape(n, t, self.num_kv_heads, groups, self.head_dim).astype(md)
            out = xla_attention(q5, k.astype(md), v.astype(md), mask, scale)
            return self.o_proj(out.astype(x.dtype).reshape(n, t, self.num_heads, -1), kernels)
        out = blocked_attention(q, k, v, mask, scale, md, x.dtype)
        return self.o_proj(out, kernels)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self, config: ModelConfig, *, param_dtype: Any, rngs: nnx.Rngs, matmul_dtype: Any = None
    ):
        e, m = config.hidden_size, config.intermediate_size
        kw: dict[str, Any] = {
            "param_dtype": param_dtype,
            "matmul_dtype": matmul_dtype,
            "rngs": rngs,
            "std": config.initializer_range,
            "use_bias": False,
        }
        self.gate_proj = Projection((e,), (m,), ("embed", "mlp"), **kw)
        self.up_proj = Projection((e,), (m,), ("embed", "mlp"), **kw)
        self.down_proj = Projection((m,), (e,), ("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array, kernels: Kernels | None = None) -> jax.Array:
        """x [N, T, E] -> [N, T, E]; ``kernels``: see `project`."""
        gate, up = project(x, (self.gate_proj, self.up_proj), kernels)
        gate, up = checkpoint_name(gate, MLP_PROJECTIONS), checkpoint_name(up, MLP_PROJECTIONS)
        return self.down_proj(swiglu(gate, up), kernels)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` elementwise; gate, up [..., M] -> [..., M].

    The backward pass is written out (d/dg silu(g) = s + g s (1 - s) with s = sigmoid(g)) so that
    only ``gate`` and ``up`` are kept for it: autodiff of ``jax.nn.silu(g) * u`` keeps four
    [N, T, M] arrays per layer (seen in the compiled HLO of a SmolLM2 step), which the scanned
    layers stack into [num_layers, N, T, M] buffers and read back in the backward pass.
    """
    return jax.nn.silu(gate) * up


def _swiglu_forward(gate: jax.Array, up: jax.Array):
    return swiglu(gate, up), (gate, up)


def _swiglu_backward(residuals, grad_out: jax.Array):
    gate, up = residuals
    s = jax.nn.sigmoid(gate)
    grad_gate = grad_out * up * (s * (1 + gate * (1 - s)))
    grad_up = grad_out * (gate * s)
    return grad_gate, grad_up


swiglu.defvjp(_swiglu_forward, _swiglu_backward)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``; dropout on each branch."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        param_dtype: Any,
        dropout_rate: float,
        rngs: nnx.Rngs,
        matmul_dtype: Any = None,
    ):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(
            config.hidden_size, eps, names=("norm",), param_dtype=param_dtype
        )
        self.self_attn = Attention(
            config, param_dtype=param_dtype, rngs=rngs, matmul_dtype=matmul_dtype
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps, names=("norm",), param_dtype=param_dtype
        )
        self.mlp = MLP(config, param_dtype=param_dtype, rngs=rngs, matmul_dtype=matmul_dtype)
        # No RNG stream of its own: keys come from the caller (`dropout_rng`), so the stacked,
        # scanned layers stay pure functions of their parameters.
        self.dropout = nnx.Dropout(dropout_rate) if dropout_rate > 0 else None

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        deterministic: bool,
        dropout_rng: jax.Array | None = None,
        kernels: Kernels | None = None,
    ) -> jax.Array:
        """x [N, T, E] -> [N, T, E]. ``dropout_rng``: the key dropout draws from; ``mask`` as
        in `Attention`; ``kernels``: the formulation (None = `select_kernels("cpu")`'s)."""
        kernels = kernels or _CPU_KERNELS
        keys = jax.random.split(dropout_rng) if dropout_rng is not None else (None, None)
        a = self.self_attn(self.input_layernorm(x, kernels), cos, sin, mask, kernels)
        a = checkpoint_name(a, ATTENTION_OUTPUT)
        if self.dropout is not None:
            a = self.dropout(a, deterministic=deterministic, rngs=keys[0])
        h = x + a
        f = self.mlp(self.post_attention_layernorm(h, kernels), kernels)
        if self.dropout is not None:
            f = self.dropout(f, deterministic=deterministic, rngs=keys[1])
        return h + f


def remat_policy_fn(name: str) -> Any:
    """The `jax.checkpoint` policy of a decoder layer:

    - ``"full"``: recompute everything (policy None);
    - ``"save_dots"``: keep the matmul outputs;
    - ``"save_attention"``: keep what the splash attention kernel's backward needs (q, k, v, its
      output and log-sum-exp, named `kernels.ATTENTION_RESIDUALS`), recompute the rest: the
      backward runs no second attention forward, the most expensive part of a layer's forward
      at long rows, for ~(2 x hidden + 2 x kv width) x 2 bytes per token and layer (SmolLM2:
      3.1 KB). Other attention kernels keep nothing by that name: there it is ``"full"`` (the
      trainer warns: `remat_fallback`).
    - ``"save_attention_mlp"``: ``"save_attention"``'s residuals plus attention's output
      projection and the MLP's gate and up projections (`kernels.ATTENTION_OUTPUT`,
      `kernels.MLP_PROJECTIONS`): the backward recomputes only norms and elementwise operations,
      for ~(hidden + 2 x intermediate) x 2 more bytes per token and layer than
      ``"save_attention"`` (Qwen2.5-0.5B: 21 KB). With other attention kernels attention is
      recomputed and the projections are kept.
    - ``"offload_attention"``: ``"save_attention"``'s residuals, moved to the host's memory
      (``pinned_host``) after the layer's forward and brought back for its backward, the rest
      recomputed: no second attention forward for about ``"full"``'s device memory, paid in
      transfers between host and device (Qwen2.5-0.5B, 8 pairs of 2048 tokens, compiled for a
      v5e by `rewardax plan`: 13.40 GiB on the chip and 6.04 GiB on the host, against 23.5 GiB
      for ``"save_attention"`` and 13.74 GiB for ``"full"``); on that chip its step took 1.704 s
      against ``"full"``'s 1.165: the transfers cost more than the recomputed attention. On the
      CPU both memories are the host's. Like ``"save_attention"``, ``"full"`` with other
      attention kernels.
    """
    if name == "full":
        return None
    if name == "save_dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name == "save_attention":
        return jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS)
    if name == "save_attention_mlp":
        return jax.checkpoint_policies.save_only_these_names(
            ATTENTION_RESIDUALS, ATTENTION_OUTPUT, MLP_PROJECTIONS
        )
    if name == "offload_attention":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=(ATTENTION_RESIDUALS,),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ConfigError(f"remat_policy={name!r} is not one of {', '.join(REMAT_POLICIES)}.")


def remat_fallback(policy: str, kernels: Kernels | str) -> str | None:
    """Why ``policy`` acts as ``"full"`` for a run, or None when it does not: ``"save_attention"``
    and ``"offload_attention"`` keep what the splash kernel names (`ATTENTION_RESIDUALS`), and
    no other attention kernel names anything."""
    if policy not in ("save_attention", "offload_attention"):
        return None
    chosen = kernels if isinstance(kernels, Kernels) else select_kernels(kernels)
    if chosen.attention != "splash":
        return f"the attention kernel on this backend is {chosen.attention}, not splash"
    return None


# Decoders with at most this many layers run them unrolled (`Decoder.__call__`).
UNROLLED_MAX_LAYERS = 8


@jax.custom_vjp
def embed_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]``: the rows of the [V, E] table for int ids of any shape, in table's dtype.

    Its gradient sums each row's gradients in float32 and rounds once to table's dtype. Autodiff
    of a lookup of a table cast to bf16 (`nnx.Embed` with bf16 compute, which casts the table
    before the lookup) scatter-adds them in bf16: a token read ~1333 times in a batch got its
    gradient up to 3.6% off on XLA:CPU (benchmarks/bf16_gradient_sums.py), and chat-template
    tokens occur in every row.
    """
    return jnp.take(table, ids, axis=0)


def _embed_rows_fwd(table, ids):
    return jnp.take(table, ids, axis=0), (table, ids)  # the table for its shape and dtype


def _embed_rows_bwd(residuals, grad):
    table, ids = residuals
    total = jnp.zeros(table.shape, jnp.float32).at[ids].add(grad.astype(jnp.float32))
    return total.astype(table.dtype), None


embed_rows.defvjp(_embed_rows_fwd, _embed_rows_bwd)


class Decoder(nnx.Module):
    """Token embedding, ``num_hidden_layers`` decoder layers, final RMSNorm."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: Any,
        param_dtype: Any,
        remat_policy: str,
        dropout_rate: float,
        rngs: nnx.Rngs,
        matmul_dtype: Any = None,
    ):
        if remat_policy not in REMAT_POLICIES:
            raise ConfigError(
                f"remat_policy={remat_policy!r} is not one of {', '.join(REMAT_POLICIES)}."
            )
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.remat_policy = remat_policy
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=self.dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.with_partitioning(
                nnx.initializers.normal(config.initializer_range),
                ("vocab", "embed"),
                eager_sharding=False,
            ),
            rngs=rngs,
        )
        self.dropout_rate = dropout_rate
        self.layers = stack_layers(
            [
                DecoderLayer(
                    config,
                    param_dtype=param_dtype,
                    dropout_rate=dropout_rate,
                    rngs=rngs,
                    matmul_dtype=matmul_dtype,
                )
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, names=("norm",), param_dtype=param_dtype
        )

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        *,
        kernels: Kernels | None = None,
        deterministic: bool = True,
        dropout_rng: jax.Array | None = None,
    ) -> jax.Array:
        """input_ids int [N, T]; positions int [N, T]; mask bool [N, T, T] (`attention_mask`),
        or `SplashIds` when ``kernels.attention == "splash"`` -> hidden [N, T, E].
        ``kernels``: the formulation of projections and attention (`rewardax.models.kernels`;
        None = the CPU one).

        The layers run as one ``lax.scan`` over their stacked parameters: XLA compiles one layer
        instead of ``num_hidden_layers`` copies, so compile time does not grow with depth. Models
        of at most `UNROLLED_MAX_LAYERS` layers have the scan unrolled (the same program, one
        copy of the layer per layer): XLA then schedules across layers and keeps no stacked
        residuals, 6-9% faster steps for issue #7's 4-layer model on 2 cores, for a compile time
        that stays small at that depth (not with remat "offload_attention": see below).
        With ``kernels.indexed_layers`` (a TPU's) a looped scan runs over the layer indices and
        reads each layer's parameters from the stacked ones inside the remat'd body: the same
        values, faster backward passes there (`Kernels.indexed_layers`).
        ``dropout_rng`` (a key, split per layer) is required when dropout is active.
        """
        if not deterministic and self.dropout_rate > 0 and dropout_rng is None:
            raise ConfigError("dropout is active (deterministic=False): pass dropout_rng=<key>")
        kernels = kernels or _CPU_KERNELS
        # Looked up in the table's dtype and cast after: the gradient then sums each row's
        # share in float32 (`embed_rows`).
        x = embed_rows(self.embed_tokens.embedding[...], input_ids).astype(self.dtype)
        inv_freq, rope_scale = rope_inverse_frequencies(self.config)
        cos, sin = rope_cos_sin(positions, inv_freq, rope_scale)
        graphdef, stacked = nnx.split(self.layers)

        def run_layer(h: jax.Array, per_layer) -> tuple[jax.Array, None]:
            layer_state, key = per_layer
            layer = nnx.merge(graphdef, layer_state)
            return layer(h, cos, sin, mask, deterministic, key, kernels), None

        n = self.config.num_hidden_layers
        keys = jax.random.split(dropout_rng, n) if dropout_rng is not None else None
        body, xs = run_layer, (stacked, keys)
        if kernels.indexed_layers and self.layers_looped:

            def run_indexed(h: jax.Array, per_layer) -> tuple[jax.Array, None]:
                index, key = per_layer
                return run_layer(h, (jax.tree.map(lambda p: p[index], stacked), key))

            body, xs = run_indexed, (jnp.arange(n), keys)
        if self.remat_policy != "none":
            body = jax.checkpoint(body, policy=remat_policy_fn(self.remat_policy))
        x, _ = jax.lax.scan(body, x, xs, unroll=not self.layers_looped)
        return self.norm(x, kernels)

    @property
    def layers_looped(self) -> bool:
        """Whether the layers run as a loop (else unrolled: `UNROLLED_MAX_LAYERS`). Offloading
        needs the loop: unrolled, XLA:TPU kept device copies of what it offloaded (4 layers:
        more device memory than "save_attention"; looped: "full"'s)."""
        n = self.config.num_hidden_layers
        return n > UNROLLED_MAX_LAYERS or self.remat_policy == "offload_attention"


def stack_layers(layers: Sequence[DecoderLayer]) -> DecoderLayer:
    """One DecoderLayer whose every parameter has a leading ``[num_layers]`` axis (logical name
    ``layers``), built from ``layers`` in order; `Decoder` scans over that axis."""
    graphdef, first = nnx.split(layers[0])
    states = [first] + [nnx.split(layer)[1] for layer in layers[1:]]

    def stack(*variables: nnx.Variable) -> nnx.Variable:
        names = variables[0].get_metadata().get("out_sharding") or ()
        value = jnp.stack([v.get_value() for v in variables])
        return variables[0].replace(value, out_sharding=("layers", *names))

    stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, stacked)
