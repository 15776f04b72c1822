"""RewardState: a reward model's parameters with its optimizer state and step counter.

The model is kept split (NNX `graphdef` + parameter `State`) so that the jitted steps are pure functions
of arrays: `jax.jit` sees one pytree, Orbax saves it, and shardings apply leaf by leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rewardax.models import lora


@dataclass
class RewardState:
    """Everything a training step reads and writes.

    Attributes:
      graphdef: the model's static structure (not an array; never saved in checkpoints).
      params: the model's `nnx.Param` variables.
      rest: any other model variables (empty for rewardax models; kept so foreign NNX modules work).
      opt_state: the optax optimizer state for `params`.
      step: number of optimizer updates applied so far (int32 scalar array).
      rng: the base PRNG key of the run; each step folds in its step number, so a resumed run draws
        the same dropout masks as an uninterrupted one.
    """

    graphdef: Any
    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array = field(default_factory=lambda: jax.random.key_data(jax.random.key(0)))

    @classmethod
    def create(
        cls, model: nnx.Module, optimizer: optax.GradientTransformation, *, seed: int = 0
    ) -> RewardState:
        graphdef, params, rest = lora.split(model)
        return cls(
            graphdef=graphdef,
            params=params,
            rest=rest,
            opt_state=optimizer.init(params),
            step=jnp.asarray(0, jnp.int32),
            rng=jax.random.key_data(jax.random.key(seed)),
        )

    @property
    def model(self) -> nnx.Module:
        """The model rebuilt from the current parameters (a fresh object; edits do not flow back)."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    def arrays(self) -> dict[str, Any]:
        """The part that is saved in checkpoints and passed through `jax.jit`."""
        return {
            "params": self.params,
            "rest": self.rest,
            "opt_state": self.opt_state,
            "step": self.step,
            "rng": self.rng,
        }

    def replace_arrays(self, arrays: dict[str, Any]) -> RewardState:
        return RewardState(graphdef=self.graphdef, **arrays)
