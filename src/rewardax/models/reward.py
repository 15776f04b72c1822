"""RewardModel: decoder backbone + linear ``score`` head read at chosen token positions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from rewardax.errors import ConfigError
from rewardax.models.config import ModelConfig
from rewardax.models.hf import save_pretrained
from rewardax.models.kernels import KERNEL_SETTINGS, Kernels, compute_dtype, select_kernels
from rewardax.models.transformer import Decoder, Projection, SplashIds
from rewardax.models.transformer import attention_mask as build_attention_mask


@struct.dataclass
class RewardOutput:
    """What ``RewardModel.__call__`` returns (a pytree, so it can leave ``jax.jit``).

    Attributes:
      logits: float32 rewards, ``[N, num_labels]`` (one per row) or ``[N, K, num_labels]`` when
        ``reward_positions`` is ``[N, K]``. Always float32 whatever the compute dtype.
      hidden_states: final-norm hidden states ``[N, T, E]`` in the compute dtype, only when
        ``output_hidden_states=True``; else None.
    """

    logits: jax.Array
    hidden_states: jax.Array | None = None


def last_token_index(attention_mask: jax.Array) -> jax.Array:
    """Index of the last position whose mask is 1 in each row: int32 [N] (0 for an empty row).

    Works for left and right padding alike and never looks at token ids (pad == EOS in SmolLM2).
    """
    mask = attention_mask.astype(bool)
    t = mask.shape[-1]
    idx = jnp.arange(t, dtype=jnp.int32)
    return jnp.max(jnp.where(mask, idx, 0), axis=-1)


def default_positions(attention_mask: jax.Array) -> jax.Array:
    """Position ids ``max(cumsum(mask) - 1, 0)``: int32 [N, T]; left padding starts at 0."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


_DTYPES = ("float32", "bfloat16", "float16")


def _check_dtype(name: str, value: Any) -> jnp.dtype:
    try:
        dt = jnp.dtype(value)
    except TypeError as exc:
        raise ConfigError(f"{name}={value!r} is not a dtype; use one of {_DTYPES}.") from exc
    if dt.name not in _DTYPES:
        raise ConfigError(f"{name}={value!r} is not supported; use one of {_DTYPES}.")
    return dt


class RewardModel(nnx.Module):
    """A decoder transformer with a scalar (or ``num_labels``-wide) reward head.

    Args:
      config: the architecture.
      dtype: compute dtype ("float32", "bfloat16", or "auto": float32 on a CPU, bfloat16 on
        a TPU or GPU, `kernels.compute_dtype`); attention softmax, norms and the reward head
        always run in float32. Float32 matmuls are float32 on every backend (a TPU's
        default would be one bf16 pass; `Kernels.products`).
      param_dtype: storage dtype of the parameters (e.g. float32 master weights, bf16 compute).
      matmul_dtype: dtype the inputs of every projection matmul and of attention's products
        (q.k, probabilities x values, and their gradients) are cast to (float32 accumulation);
        None = ``dtype``. "bfloat16" with float32 ``dtype`` keeps activations, norms, softmax
        and its row sums in float32 and runs only the matmuls in bf16.
      remat_policy: gradient checkpointing per decoder layer: "none", "full" (recompute all),
        "save_dots" (keep matmul outputs without batch dims, recompute the rest),
        "save_attention" (keep the splash attention kernel's output and residuals),
        "save_attention_mlp" (those, attention's output projection and the MLP's gate and up
        projections: recompute only norms and elementwise operations),
        "offload_attention" (keep them in host memory).
      dropout_rate: residual dropout after attention and MLP; active only with
        ``deterministic=False``.
      rngs: parameter (and dropout) randomness.
      kernels: the formulation of projections and attention (`rewardax.models.kernels`):
        "auto" (the backend's: "cpu" on CPU, "pallas" on TPU, "xla" elsewhere), "cpu" (XLA:CPU's
        written backwards and blocked attention), "xla" (autodiff, one fused einsum attention)
        or "pallas" (autodiff, splash attention; Pallas interpret mode off a TPU), or a
        `Kernels` (e.g. other splash tiles). Resolved when the model is traced; the formulations
        agree to rounding.

    Example::

        model = RewardModel(ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2), rngs=nnx.Rngs(0))
        out = model(jnp.array([[5, 6, 7, 0]]), jnp.array([[1, 1, 1, 0]]))
        out.logits  # float32 [1, 1], read at index 2
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: Any = "float32",
        param_dtype: Any = "float32",
        remat_policy: str = "none",
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
        matmul_dtype: Any = None,
        kernels: str | Kernels = "auto",
    ):
        if not 0.0 <= dropout_rate < 1.0:
            raise ConfigError(f"dropout_rate={dropout_rate} must be in [0, 1).")
        if not isinstance(kernels, Kernels) and kernels not in KERNEL_SETTINGS:
            raise ConfigError(f"kernels={kernels!r} is not one of {', '.join(KERNEL_SETTINGS)}.")
        self.kernels = kernels
        self.config = config
        self.dtype = _check_dtype("dtype", compute_dtype(dtype))
        self.param_dtype = _check_dtype("param_dtype", param_dtype)
        self.matmul_dtype = (
            None if matmul_dtype is None else _check_dtype("matmul_dtype", matmul_dtype)
        )
        self.model = Decoder(
            config,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            remat_policy=remat_policy,
            dropout_rate=dropout_rate,
            rngs=rngs,
            matmul_dtype=self.matmul_dtype,
        )
        # std 1/sqrt(hidden+1): unit-variance rewards for unit-variance features at the start.
        self.score = Projection(
            (config.hidden_size,),
            (config.num_labels,),
            ("embed", "labels"),
            use_bias=False,
            std=1.0 / math.sqrt(config.hidden_size + 1),
            param_dtype=self.param_dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        branch_ids: jax.Array | None = None,
        reward_positions: jax.Array | None = None,
        deterministic: bool = True,
        dropout_rng: jax.Array | None = None,
        output_hidden_states: bool = False,
    ) -> RewardOutput:
        """Rewards for a batch of (possibly padded, packed or prompt-sharing) rows.

        Args:
          input_ids: int [N, T].
          attention_mask: int/bool [N, T], 1 = real token. None = all ones (or
            ``segment_ids != 0`` when segment ids are given).
          positions: int [N, T] RoPE positions; default ``max(cumsum(mask) - 1, 0)``.
          segment_ids: int [N, T]; tokens attend only within their segment, 0 = padding.
            Default: ``attention_mask``.
          branch_ids: int [N, T] or None; a key in branch b > 0 is seen only by queries of the
            same branch, branch 0 (shared prompt) by all (still causal and within the segment).
          reward_positions: None -> the last index with mask 1 per row (logits [N, L]);
            int [N] -> that index per row ([N, L]); int [N, K] -> K rewards per row ([N, K, L]).
          deterministic: False enables dropout (if ``dropout_rate > 0``).
          dropout_rng: a PRNG key for dropout (pure train steps pass one per step); None =
            the model's own ``rngs`` stream.
          output_hidden_states: also return the final hidden states [N, T, E].

        Returns:
          RewardOutput with float32 ``logits``.
        """
        if input_ids.ndim != 2:
            raise ConfigError(f"input_ids must be [N, T], got shape {tuple(input_ids.shape)}.")
        if attention_mask is None:
            attention_mask = (
                segment_ids != 0 if segment_ids is not None else jnp.ones_like(input_ids)
            )
        attention_mask = attention_mask.astype(jnp.int32)
        if positions is None:
            positions = default_positions(attention_mask)
        if segment_ids is None:
            segment_ids = attention_mask
        chosen = self.kernels
        kernels = chosen if isinstance(chosen, Kernels) else select_kernels(chosen)
        if kernels.attention == "splash":  # the kernel builds the mask from the ids
            window = self.config.sliding_window is not None
            mask = SplashIds(segment_ids, branch_ids, positions if window else None)
        else:
            mask = build_attention_mask(
                segment_ids, positions, branch_ids, self.config.sliding_window
            )
        with kernels.products(self.matmul_dtype or self.dtype):
            hidden = self.model(
                input_ids,
                positions,
                mask,
                kernels=kernels,
                deterministic=deterministic,
                dropout_rng=dropout_rng,
            )

        if reward_positions is None:
            reward_positions = last_token_index(attention_mask)
        reward_positions = reward_positions.astype(jnp.int32)
        if reward_positions.ndim == 1:
            picked = jnp.take_along_axis(hidden, reward_positions[:, None, None], axis=1)[:, 0]
        elif reward_positions.ndim == 2:
            picked = jnp.take_along_axis(hidden, reward_positions[:, :, None], axis=1)
        else:
            raise ConfigError(
                f"reward_positions must be [N] or [N, K], got shape {tuple(reward_positions.shape)}."
            )
        # The head runs in float32 on the few picked positions: rewards are compared across
        # pairs, and bf16 (8 bits of mantissa) would round away small margins.
        logits = jax.lax.dot_general(
            picked.astype(jnp.float32),
            self.score.kernel[...].astype(jnp.float32),
            (((picked.ndim - 1,), (0,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST,
        )
        return RewardOutput(logits=logits, hidden_states=hidden if output_hidden_states else None)

    def save_pretrained(
        self,
        directory: str | Path,
        tokenizer: Any = None,
        extra_config: dict[str, Any] | None = None,
        *,
        overwrite: bool = False,
    ) -> Path:
        """Write a Hugging Face ``*ForSequenceClassification`` directory; see ``models.hf``."""
        return save_pretrained(
            self, directory, tokenizer=tokenizer, extra_config=extra_config, overwrite=overwrite
        )
