"""Rewards [G, K] of a K-branch batch (`rewardax.data.packing.pack_groups`) from one forward pass.

The model reads S reward positions per row (`reward_positions` [R, S]) and returns logits
[R, S, L]; `reward_slot` [G, K] says which of the R*S slots holds response k of group g. This is
the group counterpart of `steps.pair_rewards`' packed branch, kept apart from the train step so
that the step (and its listwise losses, `rewardax.ranking_losses`) can call it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rewardax.errors import ConfigError


def rewards_by_slot(
    logits: jax.Array, reward_slot: jax.Array, response_mask: jax.Array
) -> jax.Array:
    """Per-response rewards of a packed batch.

    Args:
      logits: [R, S, L], the model's output for reward_positions [R, S].
      reward_slot: int [G, K], flat index into R*S of each response's reward.
      response_mask: [G, K], 1 for a real response, 0 for a padding slot.

    Returns:
      float32 [G, K, L]; 0 at padding slots (their slot index is 0, a real response's slot or
      an unused one: zeroing keeps its value, and its gradient, out of every loss).

    Example: logits [[[0.5], [-1.0], [2.0]]] (one row, 3 slots), reward_slot [[2, 0], [1, 0]],
    response_mask [[1, 1], [1, 0]] -> [[[2.0], [0.5]], [[-1.0], [0.0]]].
    """
    if logits.ndim != 3:
        raise ConfigError(
            f"logits must be [R, S, L] (the model's output for reward_positions [R, S]), got "
            f"shape {tuple(logits.shape)}"
        )
    if reward_slot.shape != response_mask.shape or reward_slot.ndim != 2:
        raise ConfigError(
            f"reward_slot {tuple(reward_slot.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [G, K]"
        )
    r, s, num_labels = logits.shape
    # float32: rewards are compared across responses; a bfloat16 head output would round them.
    flat = logits.astype(jnp.float32).reshape(r * s, num_labels)
    rewards = flat[reward_slot]  # [G, K, L]
    return jnp.where(response_mask[..., None] > 0, rewards, 0.0)


def group_rewards(model: nnx.Module, batch: dict, *, dropout_rng: jax.Array | None = None):
    """The first score head's reward of every response of a K-branch batch, one forward pass.

    Returns:
      float32 [G, K]; 0 at padding slots (response_mask 0).
    """
    kwargs = {}
    if dropout_rng is not None:
        kwargs = {"deterministic": False, "dropout_rng": dropout_rng}
    out = model(
        batch["input_ids"],
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
        branch_ids=batch["branch_ids"],
        reward_positions=batch["reward_positions"],
        **kwargs,
    )
    return rewards_by_slot(out.logits, batch["reward_slot"], batch["response_mask"])[..., 0]
