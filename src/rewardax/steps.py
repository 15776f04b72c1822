"""The jitted training and evaluation steps: pure functions of (state arrays, batch).

A batch is a dict of arrays with the pair axis explicit (see `rewardax.data`):
  input_ids [B, 2, T] int32 (index 0 = chosen, 1 = rejected), attention_mask [B, 2, T],
  reward_index [B, 2] int32, margin [B] float32, pair_mask [B] float32 (0 = padding pair).
Both responses of every pair go through the model in ONE forward pass of shape [2B, T].
A packed batch (`rewardax.data.packing`: rows [R, T] with segment ids, `reward_slot` [B, 2]) goes
through one forward pass of shape [R, T]; the loss and metrics code is the same for both.

A group batch (`rewardax.data.collate_groups`; train.loss other than bradley_terry) holds K
responses per row: input_ids / attention_mask [B, K, T], reward_index [B, K], response_mask
[B, K] (0 = a padded response of a row with fewer than K), `ranks` [B, K] (lower is better) or
`scores` [B, K] (score rows, K = 1), row_mask [B]. Its K responses per row go through one
forward pass of shape [B*K, T]; `group_logits` is `pair_rewards`'s counterpart and
`losses.group_metric_sums` the loss (formulas in `rewardax.ranking_losses`).
With model.objectives the score rows carry named scores, `scores` [B, 1, L] and `score_mask`
[B, 1, L]: head output i is trained on objective i with mse over the rows that score it, and the
objectives' mean losses are summed with their weights (`objective_sums`,
`losses.combine_objectives`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rewardax import losses
from rewardax.errors import ConfigError
from rewardax.models.kernels import Kernels, select_kernels
from rewardax.optim import FusedAdamW
from rewardax.sharding import batch_sharding, replicated, traced_in_mesh

Batch = dict[str, jax.Array]
Arrays = dict[str, Any]


def _head_outputs(model: nnx.Module, batch: Batch, dropout_rng: jax.Array | None) -> jax.Array:
    """The score head's outputs for a batch of either layout, in one forward pass: packed or
    K-branch rows (the batch has `reward_slot`) as they are, [R, S, num_labels] for
    `reward_positions` [R, S]; padded [B, n, T] responses as B*n rows, [B*n, num_labels]."""
    kwargs = {}
    if dropout_rng is not None:
        kwargs = {"deterministic": False, "dropout_rng": dropout_rng}
    if "reward_slot" in batch:
        return model(
            batch["input_ids"],
            positions=batch["positions"],
            segment_ids=batch["segment_ids"],
            branch_ids=batch.get("branch_ids"),
            reward_positions=batch["reward_positions"],
            **kwargs,
        ).logits
    b, n, t = batch["input_ids"].shape
    return model(
        batch["input_ids"].reshape(b * n, t),
        batch["attention_mask"].reshape(b * n, t),
        reward_positions=batch["reward_index"].reshape(b * n),
        **kwargs,
    ).logits


def pair_rewards(model: nnx.Module, batch: Batch, *, dropout_rng: jax.Array | None = None):
    """Scores both responses of each pair in one forward pass.

    The layout is read from the batch's keys: a packed or shared-prompt batch carries
    `reward_slot` [B, 2] (see `rewardax.data.packing`), a padded one `reward_index` [B, 2].

    Returns:
      (chosen [B], rejected [B]) float32 rewards (first score head output).
    """
    logits = _head_outputs(model, batch, dropout_rng)
    if "reward_slot" in batch:
        flat = logits[..., 0].astype(jnp.float32).reshape(-1)  # [R*S]
        rewards = flat[batch["reward_slot"]]  # [B, 2]
    else:
        rewards = logits[:, 0].astype(jnp.float32).reshape(-1, 2)
    return rewards[:, 0], rewards[:, 1]


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


def group_logits(model: nnx.Module, batch: Batch, *, dropout_rng: jax.Array | None = None):
    """Scores the K responses of each row of a group batch in one forward pass: [B*K, T] padded
    rows, or K-branch rows (data.layout=shared_prompt) read through `rewards_by_slot`.

    Returns:
      [B, K, num_labels] float32 head outputs; [..., 0] is the reward.
    """
    logits = _head_outputs(model, batch, dropout_rng)
    if "reward_slot" in batch:
        return rewards_by_slot(logits, batch["reward_slot"], batch["response_mask"])
    b, k = batch["input_ids"].shape[:2]
    return logits.astype(jnp.float32).reshape(b, k, -1)


def group_targets(batch: Batch, loss: str) -> jax.Array:
    """The [B, K] targets `loss` reads from a group batch: `ranks` or `scores` (ConfigError while
    tracing when the batch carries the other kind)."""
    name = "scores" if loss in losses.SCORE_LOSSES else "ranks"
    if name not in batch:
        fits = (
            "mse or gaussian_nll"
            if "scores" in batch
            else "plackett_luce, all_pairs_bradley_terry or davidson"
        )
        raise ConfigError(f"train.loss={loss} needs `{name}` in the batch; this data fits {fits}")
    return batch[name]


def group_sums(
    logits: jax.Array, batch: Batch, loss: str, log_tie_strength: float = 0.0
) -> dict[str, jax.Array]:
    """`losses.group_metric_sums` of a group batch's head outputs ([B, K, num_labels])."""
    log_variance = None
    if loss == "gaussian_nll":
        if logits.shape[-1] < 2:
            raise ConfigError(
                "train.loss=gaussian_nll reads log σ² from the second head output; the model "
                f"has num_labels={logits.shape[-1]}: set model.num_labels=2"
            )
        log_variance = logits[..., 1]
    return losses.group_metric_sums(
        logits[..., 0],
        group_targets(batch, loss),
        batch["response_mask"],
        batch["row_mask"],
        loss,
        log_variance,
        log_tie_strength,
    )


def objective_sums(
    logits: jax.Array, batch: Batch, names: list[str] | tuple[str, ...]
) -> dict[str, jax.Array]:
    """`losses.objective_metric_sums` of a named-score group batch's head outputs
    ([B, 1, num_labels], one output per objective in `names` order)."""
    if "score_mask" not in batch:
        raise ConfigError(
            f"model.objectives={list(names)} trains named scores; this batch has none (its rows "
            "have one `score`, or are not score rows)"
        )
    if logits.shape[-1] != len(names):
        raise ConfigError(
            f"model.objectives names {len(names)} objectives but the head has "
            f"{logits.shape[-1]} outputs"
        )
    return losses.objective_metric_sums(
        logits,
        batch["scores"],
        batch["score_mask"],
        batch["response_mask"],
        batch["row_mask"],
        names,
    )


def objective_totals(batch: Batch, names: list[str] | tuple[str, ...]) -> dict[str, jax.Array]:
    """Per objective, the rows of the whole batch that score it (at least 1): each microbatch
    divides its sums by these, so that accumulated gradients equal the whole batch's."""
    scored = batch["row_mask"].astype(jnp.float32)[:, None] * batch["score_mask"][:, 0, :]
    return {name: jnp.maximum(jnp.sum(scored[:, i]), 1.0) for i, name in enumerate(names)}


def _microbatches(batch: Batch, accumulation_steps: int) -> Batch:
    """[B, ...] -> [A, B/A, ...] taking every A-th pair, so that each device's shard of the batch
    holds its share of every microbatch (a contiguous split would put a microbatch on few devices)."""

    def split(x):
        b = x.shape[0]
        return x.reshape(b // accumulation_steps, accumulation_steps, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def make_train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    accumulation_steps: int = 1,
    center_coefficient: float | None = None,
    dropout: bool = False,
    offload_state: bool = False,
    offload_params: bool = False,
    compute_dtype: Any = jnp.bfloat16,
    loss: str = "bradley_terry",
    objective_weights: dict[str, float] | None = None,
    log_tie_strength: float = 0.0,
) -> Callable[[Arrays, Batch], tuple[Arrays, dict[str, jax.Array]]]:
    """Builds `train_step(arrays, batch) -> (new_arrays, metrics)` (not yet jitted).

    `objective_weights` ({objective: weight}, in head-output order; model.objectives) trains a
    multi-objective head on named-score batches with `loss` mse: the loss is
    `losses.combine_objectives` of each objective's mean squared error over the rows of the
    whole batch that score it; metrics add `mse/NAME` per objective.

    `loss` is `bradley_terry` (pair batches) or one of `losses.GROUP_LOSSES` (group batches:
    each microbatch's loss is its sum over real rows divided by the real rows of the whole
    batch, as for pairs; metrics from `losses.group_metrics_from_sums`); `log_tie_strength` is
    the davidson loss's θ.

    Gradients are accumulated over `accumulation_steps` microbatches inside the step (a `lax.scan`);
    each microbatch's loss is its SUM over real pairs divided by the real pairs of the whole batch,
    so the update equals one large batch's. If the loss or the gradient norm is not finite the
    update is not applied (parameters and optimizer state are returned unchanged) and
    `metrics["nonfinite"]` is 1; the caller decides whether that is an error or a skipped step.
    With `offload_state` the optimizer state arrives in host memory
    (`sharding.optimizer_state_shardings(..., offload=True)`): it is copied to the device for the
    update and the new state back to the host. With `offload_params` the parameters (float32
    master weights) arrive there too: the forward and backward pass run on a `compute_dtype`
    copy made on the device (`device_copy`), and the fused AdamW update streams each parameter.
    """

    groups = loss != "bradley_terry"
    if groups and loss not in losses.GROUP_LOSSES:
        raise ConfigError(f"unknown loss {loss!r}; expected bradley_terry or {losses.GROUP_LOSSES}")
    real_key = "row_mask" if groups else "pair_mask"
    metrics_from_sums = losses.group_metrics_from_sums if groups else losses.metrics_from_sums
    names = list(objective_weights) if objective_weights else None
    if names is not None:
        if loss != "mse":
            raise ConfigError(
                f"model.objectives trains each objective with train.loss=mse; got {loss}"
            )
        weights = dict(objective_weights)

        def metrics_from_sums(sums):
            return losses.objective_metrics_from_sums(sums, weights)

    def micro_loss(params, rest, micro: Batch, total_pairs, rng):
        model = nnx.merge(graphdef, params, rest)
        if names is not None:  # total_pairs: {objective: its scored rows in the whole batch}
            sums = objective_sums(group_logits(model, micro, dropout_rng=rng), micro, names)
            means = {n: sums[f"loss/{n}"] / total_pairs[n] for n in names}
            return losses.combine_objectives(means, weights), sums
        if groups:
            logits = group_logits(model, micro, dropout_rng=rng)
            sums = group_sums(logits, micro, loss, log_tie_strength)
            return sums["loss"] / total_pairs, sums
        chosen, rejected = pair_rewards(model, micro, dropout_rng=rng)
        sums = losses.reward_metric_sums(
            chosen, rejected, micro["margin"], micro["pair_mask"], center_coefficient
        )
        return sums["loss"] / total_pairs, sums

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def train_step(arrays: Arrays, batch: Batch):
        if accumulation_steps > 1 and "reward_slot" in batch:
            # Rows of a packed batch hold sequences of several pairs: only a batch packed as
            # microbatches (`packing.pack_microbatches`) splits along axis 0. Its reward slots
            # per row are one microbatch's pairs' (one whole batch's when packed at once).
            # Raised while tracing, before any work.
            slots = batch["reward_positions"].shape[1] * accumulation_steps
            if slots != batch["reward_slot"].size:
                raise ConfigError(
                    f"gradient_accumulation_steps={accumulation_steps} with a packed batch needs "
                    "it packed as that many microbatches (PreferenceLoader(..., microbatches="
                    f"{accumulation_steps}), as RewardTrainer does); this one was packed whole"
                )
        master, rest, step = arrays["params"], arrays["rest"], arrays["step"]
        params = device_copy(master, compute_dtype) if offload_params else master
        total_pairs = jnp.maximum(jnp.sum(batch[real_key].astype(jnp.float32)), 1.0)
        if names is not None:
            total_pairs = objective_totals(batch, names)
        step_key = jax.random.fold_in(jax.random.wrap_key_data(arrays["rng"]), step)

        def body(carry, xs):
            grads_acc, sums_acc = carry
            index, mb = xs
            rng = jax.random.fold_in(step_key, index) if dropout else None
            grads, sums = grad_fn(params, rest, mb, total_pairs, rng)
            grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
            sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
            return (grads_acc, sums_acc), None

        def body_by_reference(sums_acc, xs):  # the gradients go into `grad_sums`
            index, mb = xs
            rng = jax.random.fold_in(step_key, index) if dropout else None
            loss = lambda p: micro_loss(p, rest, mb, total_pairs, rng)  # noqa: E731
            sums = _add_gradient_into(grad_sums, loss, params)
            return jax.tree.map(jnp.add, sums_acc, sums), None

        if accumulation_steps == 1:
            # No loop: a scan of length 1 would zero-fill and add a float32 buffer the size of
            # the parameters every step (0 + g == g: the same values).
            rng = jax.random.fold_in(step_key, 0) if dropout else None
            grads, sums = grad_fn(params, rest, batch, total_pairs, rng)
        else:
            micro = _microbatches(batch, accumulation_steps)
            # The shapes of the sums, without running anything.
            zero_sums = jax.tree.map(
                lambda x: jnp.zeros(x.shape, x.dtype),
                jax.eval_shape(
                    lambda mb: grad_fn(params, rest, mb, total_pairs, None)[1],
                    jax.tree.map(lambda x: x[0], micro),
                ),
            )
            xs = (jnp.arange(accumulation_steps), micro)
            if _sums_by_reference(graphdef, params, rest):
                grad_sums = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)
                sums, _ = jax.lax.scan(body_by_reference, zero_sums, xs)
                grads = jax.tree.map(jax.freeze, grad_sums)
            else:
                zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
                (grads, sums), _ = jax.lax.scan(body, (zero_grads, zero_sums), xs)
        if offload_params:  # a float32 copy of every gradient would undo the offload
            grad_norm = jnp.sqrt(
                sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
            )
        else:
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            grad_norm = optax.tree.norm(grads)
        metrics = metrics_from_sums(sums)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)

        opt_state = arrays["opt_state"]
        # Poisoned values must never reach the state (nor, later, a checkpoint): where the step
        # is not finite, parameters and optimizer state stay as they were.
        if isinstance(optimizer, FusedAdamW):  # one pass per parameter
            # Offloaded moments are streamed through the device parameter by parameter.
            new_params, new_opt_state = optimizer.apply(
                grads,
                opt_state,
                master,
                finite,
                grad_norm,
                offload=offload_state,
                params_on_host=offload_params,
            )
            if offload_state:  # the scalars (step counts) too
                new_opt_state = jax.device_put(new_opt_state, jax.memory.Space.Host)
        else:
            # Other optimizers take their whole state to the device for the update.
            if offload_state:
                opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
            new_params = keep(new_params, params)
            new_opt_state = keep(new_opt_state, opt_state)
            if offload_state:
                new_opt_state = jax.device_put(new_opt_state, jax.memory.Space.Host)
        new_arrays = {
            "params": new_params,
            "rest": rest,
            "opt_state": new_opt_state,
            "step": step + 1,  # counts batches consumed, skipped ones too
            "rng": arrays["rng"],
        }
        metrics.update(
            grad_norm=grad_norm,
            learning_rate=schedule(step),
            nonfinite=1.0 - finite.astype(jnp.float32),
        )
        return new_arrays, metrics

    return train_step


def configured_train_step(
    config: Any,
    graphdef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    dropout: bool,
) -> Callable[[Arrays, Batch], tuple[Arrays, dict[str, jax.Array]]]:
    """`make_train_step` with a run config's (`rewardax.RewardConfig`) settings: accumulation,
    centering, offload and compute dtype. `RewardTrainer` and `rewardax plan` build their step
    here, so a new setting reaches both."""
    from rewardax.config import objective_weights as run_objective_weights  # config -> data

    return make_train_step(
        graphdef,
        optimizer,
        schedule,
        accumulation_steps=config.train.gradient_accumulation_steps,
        center_coefficient=config.train.center_rewards_coefficient,
        dropout=dropout,
        offload_state=config.optim.offload_state,
        offload_params=config.optim.offload_params,
        compute_dtype=config.model.dtype,
        loss=config.train.loss,
        objective_weights=run_objective_weights(config),
        log_tie_strength=config.train.log_tie_strength,
    )


# Parameters smaller than this stay float32 in the device copy of offloaded parameters: norm
# scales, biases, the score head (their precision matters more than their bytes).
COPY_IN_COMPUTE_DTYPE_FROM = 65_536


def _sums_by_reference(graphdef, params: Any, rest: Any) -> bool:
    """Whether a step of several microbatches adds their gradients into the running sums by
    reference (`_add_gradient_into`): where the model's kernels say so (a TPU's), its layers run
    as a loop and every trained parameter is float32.

    - Unrolled layers (at most `transformer.UNROLLED_MAX_LAYERS`): the step needed more memory
      that way, compiled for a v5e (4 layers of 1024: 686 MiB against 635; 12 layers, looped:
      1161 against 2640).
    - bf16 parameters (bf16 state, `optim.offload_params`' copies, a bf16 head beside float32
      LoRA adapters) would need bf16 sums, and where float32 and bf16 parameters met in one
      layer loop JAX 0.10.2's transpose of the loop paired references with the wrong parameters
      ("Expected cotangent type ...")."""
    model = nnx.merge(graphdef, params, rest)
    chosen = model.kernels
    kernels = chosen if isinstance(chosen, Kernels) else select_kernels(chosen)
    float32 = all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    return kernels.accumulate_by_reference and model.model.layers_looped and float32


def _add_gradient_into(grad_sums: Any, fn: Callable, params: Any) -> Any:
    """Adds the gradient of ``fn(params) -> (scalar, aux)`` at ``params`` into ``grad_sums``
    (`jax.Ref`s shaped like ``params``) and returns aux. The backward pass adds each gradient
    where it is made (`jax.vjp(...).with_refs`): the layer loop's backward adds each layer's
    share into its slice of the sum, in place, where a gradient returned by value is a stacked
    [layers, ...] buffer per microbatch, zero-filled, written, then added to the sum. Compiled
    for a TPU v5e, Qwen2.5-0.5B's step at 1 pair x 8 of 2048 needs 2.58 GiB less
    (benchmarks/README.md, 2026-12-07 third session); XLA:CPU needed more, so the CPU's kernels
    leave `Kernels.accumulate_by_reference` off."""
    out, vjp, aux = jax.vjp(fn, params, has_aux=True)
    vjp.with_refs(grad_sums)(jnp.ones_like(out))
    return aux


def device_copy(params: Any, dtype: Any) -> Any:
    """Host-resident parameters as device arrays for the forward and backward pass: the large
    matrices in ``dtype``, the rest as they are. Each parameter is brought over once the previous
    one's copy exists (an optimization barrier orders them), so that the float32 originals need
    not all be on the device at once; XLA's scheduler decides how many are (benchmarks/README.md,
    2026-12-06, measures the result with `rewardax plan`)."""
    leaves, treedef = jax.tree.flatten(params)
    out, previous = [], None
    for p in leaves:
        if previous is not None:
            p, _ = jax.lax.optimization_barrier((p, previous))
        copy = jax.device_put(p, jax.memory.Space.Device)
        if p.ndim >= 2 and p.size >= COPY_IN_COMPUTE_DTYPE_FROM:
            copy = copy.astype(dtype)
        out.append(copy)
        previous = copy
    return jax.tree.unflatten(treedef, out)


def jit_train_step(
    train_step: Callable[[Arrays, Batch], tuple[Arrays, dict[str, jax.Array]]],
    state_shardings: Any,
    mesh: jax.sharding.Mesh,
):
    """`train_step` jitted as every caller runs it: the state in and out with its own shardings
    (and donated: its buffers are reused for the new state), the batch split over the
    data-parallel axes, the metrics replicated. `RewardTrainer` runs this program and
    `rewardax plan` compiles it for a TPU slice, so what plan measures is what train runs."""
    return jax.jit(
        traced_in_mesh(train_step, mesh),
        in_shardings=(state_shardings, batch_sharding(mesh)),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=(0,),
    )


def make_eval_step(graphdef) -> Callable[[Arrays, Batch], dict[str, jax.Array]]:
    """Builds `eval_step(arrays, batch) -> {"chosen": [B], "rejected": [B]}` rewards (not jitted).

    Evaluation returns per-pair rewards rather than means so the caller can compute exact metrics
    over every real pair of a dataset (and the reward statistics stored with the exported model).
    """

    def eval_step(arrays: Arrays, batch: Batch):
        # Offloaded parameters (optim.offload_params) come to the device; a no-op otherwise.
        params = jax.device_put(arrays["params"], jax.memory.Space.Device)
        model = nnx.merge(graphdef, params, arrays["rest"])
        chosen, rejected = pair_rewards(model, batch)
        return {"chosen": chosen, "rejected": rejected}

    return eval_step


def make_group_eval_step(graphdef) -> Callable[[Arrays, Batch], dict[str, jax.Array]]:
    """Builds `eval_step(arrays, group_batch) -> {"rewards": [B, K], "outputs": [B, K,
    num_labels]}` (not jitted), the group batch's counterpart of `make_eval_step` (`outputs`:
    every head output, e.g. each objective's)."""

    def eval_step(arrays: Arrays, batch: Batch):
        params = jax.device_put(arrays["params"], jax.memory.Space.Device)
        model = nnx.merge(graphdef, params, arrays["rest"])
        outputs = group_logits(model, batch)
        return {"rewards": outputs[..., 0], "outputs": outputs}

    return eval_step
