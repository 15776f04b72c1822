"""Which formulation of the projections and of attention the model runs, chosen once per backend.

A kernel tuned for one compiler is a guess on another. rewardax was tuned on XLA:CPU, where a
hand-written projection backward (`transformer.mixed_matmuls`, with a physical transpose of x so
that the weight gradient reaches YNNPACK) and a query-blocked attention with a written backward
(`transformer.attend`, with optimisation barriers) are what make a step fast
(benchmarks/README.md). On a TPU v5e those tricks cost time: the plain autodiff of the same four
bf16 projections took 1.79 ms where `mixed_matmuls` took 2.28 ms, and the blocked attention ran at
~12% of peak (issue 28). So:

| setting  | projections               | attention                                                    |
|----------|---------------------------|--------------------------------------------------------------|
| `cpu`    | `mixed_matmuls` (written) | `transformer.attend`, query blocks, written backward         |
| `xla`    | ``x @ w``, autodiff       | `xla_attention`: one einsum softmax, autodiff                |
| `pallas` | ``x @ w``, autodiff       | `pallas_attention.splash_attention`: flash kernels or splash |

`pallas` also rotates RoPE's half-heads by a product with a [D, D] matrix (`Kernels.rope_matmul`):
on a v5e the slices of the other form cost 9-12% of a step (benchmarks/README.md, 2026-12-07).

Three choices follow the backend whatever the setting: on a TPU the bf16 norm product and bias
add stay bf16 (`Kernels.float32_sums`: XLA:TPU sums their gradients in float32 by itself), with
gradient accumulation the backward pass adds into the step's running sums by reference
(`Kernels.accumulate_by_reference`: less memory there, more on XLA:CPU), and the layer loop runs
over the layer indices (`Kernels.indexed_layers`: Qwen2.5-0.5B steps 5-9% shorter on a v5e).

`Kernels.flash` (on a TPU) runs causal attention within segments through rewardax's own Pallas
kernels (`flash_attention`: each row's keys and values, and in the backward the query group's
rows, resident in VMEM, the loops over tiles inside the kernel, the diagonal's all-masked
quarters left out) instead of splash; the tree mask, sliding windows and rows too long for the
kernels' VMEM still run splash. On a v5e, 16 x 2048 of Qwen2.5-0.5B's heads
(`benchmarks/attention_ablation.py`, 2026-12-08): kernels 2.10 + 3.92 ms (35.5% of peak) against
splash's 8.46 ms (25.3%); through `splash_attention` as the model calls it 7.11 ms (30.0%)
against 10.94 (19.5%, `benchmarks/tpu_bench.py --set attention`). Compiled for a v5e
(tests/test_plan.py), remat offload_attention needs more device memory with flash than remat
full (304.6 MB against 285.8 in the test's model: flash's full needs 31.6 MB less than splash's,
its offload 9.8 MB more), so `plan` offers offloading only where splash runs.

`auto` (the default) is `cpu` on the CPU backend, `pallas` on a TPU and `xla` elsewhere (GPUs).
The splash kernel covers every layout: causal attention within segments (padding, packed rows,
GQA) with a static mask, the shared-prompt branch mask and Mistral's sliding window with a mask
built on the device per row (`pallas_attention`). Off a TPU, `pallas` runs the kernel in Pallas'
interpret mode: slow, for tests only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from rewardax.errors import ConfigError

KERNEL_SETTINGS = ("auto", "cpu", "xla", "pallas")
AttentionImpl = Literal["cpu_blocked", "xla", "splash"]

# Splash attention tiles (queries x keys) on a TPU. JAX's default of 128 is slow on a v5e: JAX's
# flash attention ran fwd+bwd in 73.9 ms with 128-blocks and 20.0-20.7 ms with 512 or 1024 blocks
# for Qwen2.5-0.5B heads at 16 x 2048 (../shared/TPU.md). Splash on the same shapes
# (benchmarks/tpu_bench.py --set tune, 2026-12-05): 512 x 512 tiles, fused backward 14.03 ms;
# forward 1024 x 1024 computed 512 keys at a time, backward 1024 x 1024, fused: 11.96 ms (17.9%
# of peak), the fastest of 11 tilings; 2048-query forward tiles run out of VMEM. Rows shorter
# than a tile get tiles of their (128-rounded) length.
SPLASH_BLOCK = 1024
SPLASH_KV_COMPUTE = 512
# rewardax's flash kernels' tiles on a TPU (`flash_attention.FlashTiles`: forward query tile and
# key chunk, backward query chunk and key tile), the fastest measured on a v5e with the diagonal
# split (benchmarks/attention_ablation.py, 2026-12-08, 16 x 2048 of Qwen2.5-0.5B's heads:
# forward 1024 x 1024 2.10 ms against 2.19 for 512 x 512 and 2.51 for 1024 x 512; backward
# 1024 x 1024 3.92 ms against 4.04 for 512 x 512). Rows that 1024 would pad more than 512 does
# take 512 (`pallas_attention.flash_tiles`).
FLASH_TILES = (1024, 1024, 1024, 1024)

# The checkpoint name of the attention kernel's output and backward residuals
# (remat policy "save_attention").
ATTENTION_RESIDUALS = "attention_residuals"
# The checkpoint names of a decoder layer's other matmul outputs that remat policy
# "save_attention_mlp" keeps besides: attention's output projection, and the MLP's gate and up
# projections. With them the backward recomputes only norms and elementwise operations.
ATTENTION_OUTPUT = "attention_output"
MLP_PROJECTIONS = "mlp_projections"
# A TPU vector register's lanes: the minor dimension of an array is laid out in tiles this wide.
LANES = 128


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A resolved choice (hashable: it is a static argument of the traced model).

    Attributes:
      name: the setting it came from after `auto` was resolved: `cpu`, `xla` or `pallas`.
      written_projection_backward: `transformer.mixed_matmuls` (True) or autodiff of ``x @ w``.
      attention: `cpu_blocked`, `xla` or `splash`.
      block_q, block_kv: splash tiles; rows are padded to a multiple of the query tile.
      block_kv_compute: the keys per step inside a key tile (divides block_kv; None = block_kv).
      bwd_block_q, bwd_block_kv: the backward kernels' tiles (None = the forward's).
      fused_backward: splash's fused dq/dk/dv backward kernel instead of two kernels.
      interpret: run the splash kernel in Pallas' interpret mode (any backend; tests).
      dense_residuals: what remat keeps of the splash kernel (`ATTENTION_RESIDUALS`) is stored
        as rows of 128 values when a head is narrower: a TPU lays a [.., T, 64] array out in
        128-wide tiles, half of them empty (`traced_under`). Less memory for "save_attention"
        and "offload_attention" (benchmarks/results/remat_memory_v5e_2026-12-06.md), paid in
        two relayout copies per residual per step: on a v5e chip "save_attention" steps were
        1.8-4.3% slower (benchmarks/results/tpu_v5e_2026-12-06c_offload_attention.md), so off.
      rope_matmul: RoPE's rotated half as a product with a [D, D] matrix instead of two slices
        and a concatenation (`transformer.apply_rope`): on a TPU, where half-width slices of
        a head cost 128-wide tiles and memory passes.
      float32_precision: the matmul precision that float32 products are traced under
        (``jax.default_matmul_precision``): "highest" off the CPU, None (as traced) on XLA:CPU.
      float32_sums: with bf16 compute, the RMSNorm weight's product and the projection bias's
        add taken in float32 and rounded once (`transformer.RMSNorm`, `transformer.add_bias`):
        the same values, their gradients (sums over every token) then summed in float32.
        XLA:CPU sums the bf16 formulation's gradients in bf16 (up to 2.1% off, 16384 tokens);
        XLA:TPU sums them in float32 by itself (a v5e: 2.9e-3 against 2.4e-3 for the norm, the
        same bits for the bias, both within the bf16 rounding of the result), and there the
        float32 form cost 10 ms of a 407 ms step (Qwen2.5-0.5B, 16 x 512; benchmarks/results/
        tpu_v5e_2026-12-07c_bf16_sums.md). So off on a TPU, on elsewhere.
      accumulate_by_reference: with gradient accumulation, each microbatch's backward pass adds
        the float32 parameters' gradients into the step's running sums in place (`jax.Ref`s,
        `rewardax.steps`) instead of returning them. Compiled for a v5e: 2.58 GiB less for
        Qwen2.5-0.5B at 1 pair x 8 of 2048, and no per-microbatch add. On XLA:CPU the step
        needed more memory that way (twice the temporaries of a small model), so on a TPU only.
      indexed_layers: the layer loop runs over the layer indices and each step reads its
        layer's parameters from the stacked ones (inside the remat'd body), instead of running
        over the stacked parameters themselves. The same values. Compiled for a v5e with sums
        by reference, the backward pass then adds each MLP weight's gradient into its slice of
        the sum inside the matmul's fusion; over the stacked parameters XLA first copied that
        slice out (one float32 [hidden, intermediate] copy per MLP matrix, layer and
        microbatch: ~19 ms of a 372 ms Qwen2.5-0.5B step at 16 x 512, ~27 of 825 at 8 x 2048,
        in the chip's profile), and the per-layer bf16 copies of the MLP weights go too, in no
        more memory. On the chip (`benchmarks/tpu_bench.py --set indexed`, 2026-12-07 fifth
        session): 0.5B 57.0% MFU against 54.0% at 8 x 2048, 55.9% against 51.1% at 16 x 512;
        SmolLM2-135M +0.2 points; Qwen2.5-1.5B (bf16 parameters, no accumulation) 63.7%
        against 63.3%. On a TPU only: not measured elsewhere.
      flash: with `splash`, the tiles (`FLASH_TILES`' order) of rewardax's own kernels
        (`flash_attention`), which then run causal attention within segments (padded and
        packed rows) in splash's place: the tile fields above are splash's only. The branch
        mask, sliding windows and rows too long for the kernels' VMEM run splash whatever this
        says. None: splash. `FLASH_TILES` on a TPU (the tiles measured fastest), None
        elsewhere (interpret mode: tests choose it themselves).
    """

    name: str
    written_projection_backward: bool
    attention: AttentionImpl
    block_q: int = SPLASH_BLOCK
    block_kv: int = SPLASH_BLOCK
    block_kv_compute: int | None = SPLASH_KV_COMPUTE
    bwd_block_q: int | None = None
    bwd_block_kv: int | None = None
    fused_backward: bool = True
    interpret: bool = False
    dense_residuals: bool = False
    rope_matmul: bool = False
    float32_precision: str | None = None
    float32_sums: bool = True
    accumulate_by_reference: bool = False
    indexed_layers: bool = False
    flash: tuple[int, int, int, int] | None = None

    def products(self, matmul_dtype: Any) -> contextlib.AbstractContextManager:
        """The context to trace the model's products in, for matmul inputs of ``matmul_dtype``:
        ``jax.default_matmul_precision(float32_precision)`` for float32, nothing otherwise.
        Autodiff's backward products inherit the precision of the forward ones."""
        if self.float32_precision is None or jnp.dtype(matmul_dtype) != jnp.float32:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.float32_precision)


def select_kernels(setting: str = "auto", backend: str | None = None) -> Kernels:
    """The kernels for ``setting`` (one of `KERNEL_SETTINGS`) on ``backend`` (default:
    ``jax.default_backend()``: "cpu", "tpu", "gpu"/"cuda"/"rocm").

    Example::

        select_kernels("auto", "tpu")  # Kernels(name='pallas', ..., attention='splash')
        select_kernels("auto", "cpu")  # Kernels(name='cpu', ..., attention='cpu_blocked')
    """
    if setting not in KERNEL_SETTINGS:
        raise ConfigError(f"kernels={setting!r} is not one of {', '.join(KERNEL_SETTINGS)}.")
    # Only here, when a model is traced: asking for the backend starts it, which
    # `import rewardax` must not do (rewardax.hostmem applies only before the first computation).
    backend = backend or jax.default_backend()
    tpu = backend == "tpu"
    # What follows the backend whatever the setting (`Kernels`' attributes say why).
    by_backend = dict(
        float32_precision=None if backend == "cpu" else "highest",
        float32_sums=not tpu,
        accumulate_by_reference=tpu,
        indexed_layers=tpu,
    )
    if setting == "auto":
        setting = {"cpu": "cpu", "tpu": "pallas"}.get(backend, "xla")
    if setting == "cpu":
        return Kernels(
            "cpu", written_projection_backward=True, attention="cpu_blocked", **by_backend
        )
    if setting == "xla":
        return Kernels("xla", written_projection_backward=False, attention="xla", **by_backend)
    return Kernels(
        "pallas",
        written_projection_backward=False,
        attention="splash",
        interpret=not tpu,
        rope_matmul=True,
        flash=FLASH_TILES if tpu else None,
        **by_backend,
    )


def compute_dtype(setting: Any, backend: str | None = None) -> Any:
    """``model.dtype`` after ``auto``: float32 on a CPU, bfloat16 on a TPU or GPU; any other value
    is returned as it is.

    Parameters and optimizer state stay in ``param_dtype`` (float32 by default) and the loss is
    computed in float32 whatever this is. On a TPU v5e bf16 compute is what reaches the chip's
    197 TFLOP/s (benchmarks/README.md); XLA:CPU's float32 path is the one tuned there (a bf16
    gain needs bf16 units, see ``model.matmul_dtype``).
    """
    if not (isinstance(setting, str) and setting == "auto"):
        return setting
    return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


def remat_candidates(kernels: Kernels) -> tuple[str, ...]:
    """``model.remat_policy`` ``auto``: the policies to try, fastest first, for a step that
    must fit the device (`rewardax.plan.choose_remat` takes the first that fits).

    With the splash kernel (a TPU): `save_attention_mlp`, then `save_attention`, then `full`.
    On a v5e (tpu_bench.py --set accumulate, benchmarks/results/tpu_v5e_2026-12-07d_accumulate.md)
    `save_attention_mlp` beat keeping every activation (`none`) at the same microbatches (SmolLM2
    at 2048 tokens, 2 pairs x 8: 40.8% MFU against 38.6%; at 512, 8 pairs x 4: 37.3% against
    34.1%) and `save_attention` at 0.5B (1 pair x 8 of 2048: 54.0% against 49.8%). `none` is not
    tried there: it keeps all that `save_attention_mlp` keeps and more, so it fits only where
    `save_attention_mlp` does, and was slower. `save_attention` runs no second attention forward
    (Qwen2.5-0.5B at 2048, 2026-12-05: 45.6% against 36.3% with `full`). Without splash the
    `save_attention*` policies keep nothing: `none`, then `full`. `save_dots` was slower than
    `full` on the v5e."""
    if kernels.attention == "splash":
        return ("save_attention_mlp", "save_attention", "full")
    return ("none", "full")


def halvings_past_fit(kernels: Kernels, policy: str) -> int:
    """How many more times `rewardax.plan.choose_remat` halves the microbatch after the first
    one with which ``policy`` fits the device (while a microbatch keeps
    `plan.MIN_MICROBATCH_TOKENS`).

    1 for `save_attention_mlp` with the splash kernel: on a v5e (same run as
    `remat_candidates`') the microbatch after the first that fits was the faster one wherever
    one was left to halve: Qwen2.5-0.5B at 16 x 512, 2 pairs x 8 51.0% MFU against 4 x 4 (the
    first that fits) 49.8% (and 1 x 16 45.9%); SmolLM2 at 16 x 2048, 2 x 8 40.8% against 4 x 4
    39.7% (by-value sums, 2026-12-07c) (and 1 x 16 38.9%); `none` did the same (SmolLM2 at
    32 x 512, 8 x 4 34.1% against 16 x 2 32.6%). Not for `save_attention` (0.5B at 8 x 2048:
    2 x 4, the first that fits, 51.2% against 1 x 8 49.8%) nor `full` (not measured), nor other
    kernels (not measured)."""
    if kernels.attention == "splash" and policy == "save_attention_mlp":
        return 1
    return 0


def traced_under(
    precision: str, fn: Callable[..., Any], name: str | None = None, dense: bool = False
) -> Callable[..., Any]:
    """``fn`` with its forward and its backward traced under
    ``jax.default_matmul_precision(precision)``.

    A context around a call covers the forward only: a `jax.custom_vjp`'s backward (a Pallas
    kernel's, a written one) is traced later, when the gradient is taken, under whatever
    precision is current then. Non-float inputs get no cotangent (float0), as from `jax.vjp`.

    ``name``: when differentiated, fn's output and everything its backward keeps are marked
    with `jax.ad_checkpoint.checkpoint_name` (a remat policy that saves the name then runs no
    second forward of fn: `transformer.remat_policy_fn("save_attention")`). ``dense``: each of
    them whose minor dimension is narrower than 128 (and divides it) is marked in the shape
    [..., n / k, 128] (k of its rows in one) and read back in its own: what the policy keeps
    then fills the TPU's 128-wide tiles. Qwen2.5-0.5B, 8 pairs of 2048 tokens, compiled for a
    v5e: the "save_attention" step needs 17.73 GiB instead of 23.5, "offload_attention" moves
    3.04 GiB to the host instead of 6.04 (`rewardax plan`).
    """
    mark = _named_lane_dense if dense else checkpoint_name

    @jax.custom_vjp
    def wrapped(*args):
        with jax.default_matmul_precision(precision):
            return fn(*args)

    def forward(*args):
        with jax.default_matmul_precision(precision):
            out, vjp_fn = jax.vjp(fn, *args)
        if name is not None:
            # Masks (bool: the splash kernel's dynamic mask tiles) stay unnamed: remat rebuilds
            # them from the token ids, where keeping them would cost a [T, T] per row and layer.
            out, vjp_fn = jax.tree.map(
                lambda a: a if jnp.result_type(a) == jnp.bool_ else mark(a, name), (out, vjp_fn)
            )
        return out, vjp_fn

    def backward(vjp_fn, cotangent):
        with jax.default_matmul_precision(precision):
            return vjp_fn(cotangent)

    wrapped.defvjp(forward, backward)
    return wrapped


def _named_lane_dense(a: jax.Array, name: str) -> jax.Array:
    """``a`` marked ``name`` (`checkpoint_name`) in the shape [..., n / k, 128] when its shape
    [..., n, d] has d < 128 and k = 128 / d whole rows per 128 (a [.., T, 64] head: two), then
    reshaped back: what a remat policy keeps is the dense form."""
    if a.ndim < 2 or not 0 < a.shape[-1] < LANES or LANES % a.shape[-1]:
        return checkpoint_name(a, name)
    rows_per_lane_row = LANES // a.shape[-1]
    if a.shape[-2] % rows_per_lane_row:
        return checkpoint_name(a, name)
    dense = a.reshape(*a.shape[:-2], a.shape[-2] // rows_per_lane_row, LANES)
    return checkpoint_name(dense, name).reshape(a.shape)


def xla_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float
) -> jax.Array:
    """Softmax attention as one einsum softmax that XLA fuses, differentiated by autodiff.

    Args:
      q: [N, T, K, G, D] queries (G query heads per key/value head), in the matmul dtype.
      k, v: [N, S, K, D].
      mask: bool [N, T, S], True where the query may see the key.
      scale: the logits' factor, 1/sqrt(D).

    Returns:
      float32 [N, T, K, G, D]. Scores and softmax in float32, probabilities rounded to v's dtype
      for the product (as `transformer.attend` does); a query that sees no key (padding) gets
      zeros, as in `transformer.attend`.
    """
    scores = jnp.einsum("ntkgd,nskd->nkgts", q, k, preferred_element_type=jnp.float32) * scale
    visible = mask[:, None, None]
    # A finite fill: a fully masked row then gives a uniform softmax (zeroed below), not NaN.
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("nkgts,nskd->ntkgd", probs, v, preferred_element_type=jnp.float32)
    sees_any = jnp.any(mask, axis=-1)  # [N, T]
    return jnp.where(sees_any[:, :, None, None, None], out, 0.0)
