"""The jitted train/eval steps on a tiny random model: values, not "it ran"."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rewardax.models import lora, transformer
from rewardax.models.config import ModelConfig
from rewardax.models.kernels import select_kernels
from rewardax.models.reward import RewardModel
from rewardax.state import RewardState
from rewardax.steps import make_eval_step, make_train_step

TINY = ModelConfig(
    architecture="llama",
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def make_state(optimizer=None, seed=0):
    model = RewardModel(TINY, rngs=nnx.Rngs(seed))
    return RewardState.create(model, optimizer or optax.sgd(0.1), seed=seed)


def random_batch(rng: np.random.Generator, pairs: int, length: int = 12) -> dict[str, np.ndarray]:
    """Right-padded pairs of random lengths; reward read at each response's last real token."""
    ids = rng.integers(1, TINY.vocab_size, size=(pairs, 2, length)).astype(np.int32)
    lengths = rng.integers(3, length + 1, size=(pairs, 2))
    mask = (np.arange(length)[None, None, :] < lengths[..., None]).astype(np.int32)
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "reward_index": (lengths - 1).astype(np.int32),
        "margin": np.zeros(pairs, np.float32),
        "pair_mask": np.ones(pairs, np.float32),
    }


def flat_params(arrays) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(arrays["params"])])


def one_step(batch, accumulation_steps=1, center=None, optimizer=None):
    state = make_state(optimizer)
    step = jax.jit(
        make_train_step(
            state.graphdef,
            optimizer or optax.sgd(0.1),
            optax.constant_schedule(0.1),
            accumulation_steps=accumulation_steps,
            center_coefficient=center,
        )
    )
    return step(state.arrays(), batch)


def test_gradient_accumulation_equals_one_large_batch():
    batch = random_batch(np.random.default_rng(0), 8)
    batch["pair_mask"][[1, 6]] = 0.0  # uneven real pairs per microbatch
    ref_arrays, ref_metrics = one_step(batch, accumulation_steps=1)
    acc_arrays, acc_metrics = one_step(batch, accumulation_steps=4)
    before = flat_params(make_state().arrays())
    ref_update = flat_params(ref_arrays) - before
    acc_update = flat_params(acc_arrays) - before
    assert np.abs(ref_update).max() > 1e-4  # the step really moved the parameters
    np.testing.assert_allclose(acc_update, ref_update, atol=1e-5, rtol=1e-4)
    for key in ("loss", "accuracy", "margin", "reward_std", "grad_norm", "num_pairs"):
        np.testing.assert_allclose(acc_metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-6)
    assert float(ref_metrics["num_pairs"]) == 6.0


ACCUMULATED = {  # name: (RewardModel settings, LoRA rank, all trained parameters float32)
    "float32": (dict(), 0, True),
    "remat full, dropout": (dict(remat_policy="full", dropout_rate=0.1), 0, True),
    "bf16 compute, splash, save_attention_mlp": (
        dict(dtype="bfloat16", kernels="pallas", remat_policy="save_attention_mlp"),
        0,
        True,
    ),
    "bf16 parameters": (dict(dtype="bfloat16", param_dtype="bfloat16"), 0, False),
    "LoRA, bf16 compute": (dict(dtype="bfloat16"), 4, True),
    "LoRA on a bf16 base (a bf16 head)": (dict(dtype="bfloat16", param_dtype="bfloat16"), 4, False),
}


def accumulating_step(settings: dict, kernels, rank: int = 0):
    """TINY built with ``settings`` and ``kernels`` (LoRA adapters of ``rank`` on q_proj and
    down_proj when given), its state, and its unjitted SGD(1.0) step of 4 microbatches."""
    model = RewardModel(TINY, rngs=nnx.Rngs(0), **{**settings, "kernels": kernels})
    if rank:
        lora.add_adapters(model, rank=rank, alpha=8.0, targets=["q_proj", "down_proj"])
    state = RewardState.create(model, optax.sgd(1.0), seed=0)
    step = make_train_step(
        state.graphdef,
        optax.sgd(1.0),
        optax.constant_schedule(1.0),
        accumulation_steps=4,
        dropout=settings.get("dropout_rate", 0) > 0,
    )
    return state, step


def parameter_update(arrays, state) -> list[np.ndarray]:
    """The float32 change of each parameter from ``state`` to ``arrays``, in leaf order."""
    return [
        np.asarray(a, np.float32) - np.asarray(b, np.float32)
        for a, b in zip(
            jax.tree.leaves(arrays["params"]),
            jax.tree.leaves(state.arrays()["params"]),
            strict=True,
        )
    ]


# In the slow suite (the default one is near its ~15 minutes): the other bf16-parameter case and
# the other LoRA case cover their paths there.
SLOW_ACCUMULATED = ("bf16 parameters", "LoRA, bf16 compute")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ACCUMULATED else n for n in ACCUMULATED],
)
def test_accumulation_by_reference_equals_by_value(name, monkeypatch):
    """`Kernels.accumulate_by_reference` (a TPU's): the gradients of float32 parameters are added
    into the running sums by each microbatch's backward pass (`steps._add_gradient_into`); by value (the
    CPU's) they are returned and added after. The updates agree to float32 rounding, whatever
    the remat policy, attention kernel, LoRA or dropout (the same masks both ways). With any
    trained bf16 parameter every gradient goes by value."""
    monkeypatch.setattr(transformer, "UNROLLED_MAX_LAYERS", 1)  # by reference: layers looped
    settings, rank, refs = ACCUMULATED[name]
    batch = random_batch(np.random.default_rng(3), 8, length=16)
    results = []
    for by_reference in (False, True):
        chosen = select_kernels(settings.get("kernels", "cpu"), "cpu")
        kernels = dataclasses.replace(chosen, accumulate_by_reference=by_reference)
        state, step = accumulating_step(settings, kernels, rank)
        # One running sum per float32 parameter is a reference, the others none.
        jaxpr = jax.make_jaxpr(step)(state.arrays(), batch)
        new_refs = sum(e.primitive.name == "new_ref" for e in jaxpr.eqns)
        leaves = jax.tree.leaves(state.arrays()["params"])
        assert all(p.dtype == jnp.float32 for p in leaves) == refs
        assert new_refs == (len(leaves) if by_reference and refs else 0)
        arrays, metrics = jax.jit(step)(state.arrays(), batch)
        results.append((parameter_update(arrays, state), metrics))
    (by_value, metrics_v), (by_ref, metrics_r) = results
    assert max(float(np.abs(u).max()) for u in jax.tree.leaves(by_value)) > 1e-4
    for v, r in zip(jax.tree.leaves(by_value), jax.tree.leaves(by_ref), strict=True):
        np.testing.assert_allclose(r, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics_r["grad_norm"], metrics_v["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(metrics_r["loss"], metrics_v["loss"], rtol=1e-6)


def first_loop_inputs(jaxpr: jax.extend.core.Jaxpr, length: int) -> list | None:
    """The per-step inputs (xs) of the first scan of ``length`` steps in ``jaxpr``, searched
    depth first in program order: in a train step, the forward pass's layer loop."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and eqn.params["length"] == length:
            return [
                v.aval for v in eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"] :]
            ]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found = first_loop_inputs(sub, length)
            if found is not None:
                return found
    return None


@pytest.mark.parametrize(
    "name", [pytest.param("float32", marks=pytest.mark.slow), "remat full, dropout"]
)
def test_indexed_layers_equal_scanned_layers(name, monkeypatch):
    """`Kernels.indexed_layers`: the layer loop runs over the layer indices and reads each
    layer's parameters from the stacked ones, instead of running over the stacked parameters.
    The updates agree to float32 rounding with the gradients summed by value and by reference,
    with remat and dropout (the same masks: the keys still come per layer)."""
    monkeypatch.setattr(transformer, "UNROLLED_MAX_LAYERS", 1)  # layers looped
    settings, _, _ = ACCUMULATED[name]
    batch = random_batch(np.random.default_rng(4), 8, length=16)
    updates = {}
    for by_reference in (False, True):
        for indexed in (False, True):
            kernels = dataclasses.replace(
                select_kernels("cpu", "cpu"),
                accumulate_by_reference=by_reference,
                indexed_layers=indexed,
            )
            state, step = accumulating_step(settings, kernels)
            # What the forward layer loop runs over: stacked float32 parameters, or indices.
            xs = first_loop_inputs(jax.make_jaxpr(step)(state.arrays(), batch).jaxpr, 2)
            assert any(x.dtype == jnp.float32 for x in xs) != indexed, xs
            assert any(x.dtype == jnp.int32 and x.shape == (2,) for x in xs) == indexed, xs
            arrays, _ = jax.jit(step)(state.arrays(), batch)
            updates[by_reference, indexed] = parameter_update(arrays, state)
    reference = updates[False, False]
    assert max(float(np.abs(u).max()) for u in reference) > 1e-4
    for key, update in updates.items():
        for u, r in zip(update, reference, strict=True):
            np.testing.assert_allclose(u, r, rtol=1e-5, atol=1e-6, err_msg=str(key))


def test_accumulation_with_float32_and_bf16_parameters_sums_by_value(monkeypatch):
    """Float32 and bf16 parameters in one step (`optim.offload_params` runs on bf16 copies of the
    matrices): every gradient is returned by value even with `Kernels.accumulate_by_reference`
    (JAX 0.10.2 mispaired references and parameters in the layer loop's transpose), and the
    update is the by-value step's."""
    monkeypatch.setattr(transformer, "UNROLLED_MAX_LAYERS", 1)  # by reference: layers looped
    kernels = dataclasses.replace(select_kernels("cpu", "cpu"), accumulate_by_reference=True)
    batch = random_batch(np.random.default_rng(4), 8, length=16)
    updates = []
    for kernels_ in (kernels, dataclasses.replace(kernels, accumulate_by_reference=False)):
        state = RewardState.create(
            RewardModel(TINY, rngs=nnx.Rngs(0), kernels=kernels_), optax.sgd(1.0)
        )
        arrays = state.arrays()
        arrays["params"] = jax.tree.map(
            lambda p: p.astype(jnp.bfloat16) if p.ndim >= 3 else p, arrays["params"]
        )
        dtypes = {p.dtype for p in jax.tree.leaves(arrays["params"])}
        assert dtypes == {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
        step = make_train_step(
            state.graphdef, optax.sgd(1.0), optax.constant_schedule(1.0), accumulation_steps=4
        )
        jaxpr = jax.make_jaxpr(step)(arrays, batch)
        assert not any(e.primitive.name == "new_ref" for e in jaxpr.eqns)
        new, _ = jax.jit(step)(arrays, batch)
        updates.append(
            jax.tree.map(
                lambda a, b: np.asarray(a, np.float32) - np.asarray(b, np.float32),
                new["params"],
                arrays["params"],
            )
        )
    for a, b in zip(*map(jax.tree.leaves, updates), strict=True):
        np.testing.assert_array_equal(a, b)
    assert max(float(np.abs(u).max()) for u in jax.tree.leaves(updates[0])) > 1e-4


def test_unrolled_layers_sum_their_gradients_by_value():
    """`Kernels.accumulate_by_reference` applies where the layers run as a loop: with at most
    `transformer.UNROLLED_MAX_LAYERS` layers (unrolled) the step needed more memory by reference,
    compiled for a v5e (`steps._sums_by_reference`)."""
    kernels = dataclasses.replace(select_kernels("cpu", "cpu"), accumulate_by_reference=True)
    state = RewardState.create(RewardModel(TINY, rngs=nnx.Rngs(0), kernels=kernels), optax.sgd(1.0))
    assert not state.model.model.layers_looped
    step = make_train_step(
        state.graphdef, optax.sgd(1.0), optax.constant_schedule(1.0), accumulation_steps=2
    )
    jaxpr = jax.make_jaxpr(step)(state.arrays(), random_batch(np.random.default_rng(5), 4))
    assert not any(e.primitive.name == "new_ref" for e in jaxpr.eqns)


def test_padding_pairs_do_not_count():
    rng = np.random.default_rng(1)
    real = random_batch(rng, 4)
    junk = random_batch(rng, 4)
    junk["pair_mask"][:] = 0.0
    junk["margin"][:] = 1e6  # anything in a padding pair must be ignored
    padded = {k: np.concatenate([real[k], junk[k]]) for k in real}
    a, ma = one_step(real)
    b, mb = one_step(padded)
    np.testing.assert_allclose(flat_params(a), flat_params(b), atol=1e-6)
    np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=1e-6)
    assert float(mb["num_pairs"]) == 4.0


def test_rewards_do_not_depend_on_batch_neighbours_or_padding():
    rng = np.random.default_rng(2)
    batch = random_batch(rng, 6, length=10)
    state = make_state()
    evaluate = jax.jit(make_eval_step(state.graphdef))
    alone = evaluate(state.arrays(), {k: v[:1] for k, v in batch.items()})
    # Same first pair, other neighbours, and 6 more columns of padding.
    wider = {k: v.copy() for k, v in random_batch(rng, 6, length=16).items()}
    for key in ("input_ids", "attention_mask"):
        wider[key][0] = 0
        wider[key][0, :, :10] = batch[key][0]
    wider["reward_index"][0] = batch["reward_index"][0]
    crowded = evaluate(state.arrays(), wider)
    for side in ("chosen", "rejected"):
        np.testing.assert_allclose(crowded[side][0], alone[side][0], atol=1e-5)


def test_loss_matches_bradley_terry_on_the_models_rewards():
    batch = random_batch(np.random.default_rng(3), 4)
    batch["margin"] = np.array([0.0, 0.5, -1.0, 2.0], np.float32)
    state = make_state()
    rewards = jax.jit(make_eval_step(state.graphdef))(state.arrays(), batch)
    diff = np.asarray(rewards["chosen"]) - np.asarray(rewards["rejected"]) - batch["margin"]
    expected = np.mean(np.log1p(np.exp(-diff)))
    _, metrics = one_step(batch)
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
    _, centred = one_step(batch, center=0.1)
    penalty = np.mean((np.asarray(rewards["chosen"]) + np.asarray(rewards["rejected"])) ** 2)
    np.testing.assert_allclose(float(centred["loss"]), expected + 0.1 * penalty, rtol=1e-5)


def test_nonfinite_step_leaves_parameters_and_optimizer_state_untouched():
    batch = random_batch(np.random.default_rng(4), 4)
    batch["margin"][2] = np.nan
    optimizer = optax.adam(1e-2)
    state = make_state(optimizer)
    step = jax.jit(make_train_step(state.graphdef, optimizer, optax.constant_schedule(1e-2)))
    arrays, metrics = step(state.arrays(), batch)
    assert float(metrics["nonfinite"]) == 1.0
    np.testing.assert_array_equal(flat_params(arrays), flat_params(state.arrays()))
    for new, old in zip(
        jax.tree.leaves(arrays["opt_state"]), jax.tree.leaves(state.opt_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    assert int(arrays["step"]) == 1  # the batch was consumed


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_tiny_model_overfits_32_pairs(accumulation_steps):
    """Chosen responses end in token 7, rejected ones in token 9: learnable from the reward token."""
    rng = np.random.default_rng(5)
    batch = random_batch(rng, 32, length=8)
    last = batch["reward_index"]
    rows = np.arange(32)
    batch["input_ids"][rows, 0, last[:, 0]] = 7
    batch["input_ids"][rows, 1, last[:, 1]] = 9
    optimizer = optax.adamw(3e-3)
    state = make_state(optimizer)
    step = jax.jit(
        make_train_step(
            state.graphdef,
            optimizer,
            optax.constant_schedule(3e-3),
            accumulation_steps=accumulation_steps,
        )
    )
    arrays = state.arrays()
    losses = []
    for _ in range(60):
        arrays, metrics = step(arrays, batch)
        losses.append(float(metrics["loss"]))
    assert float(metrics["accuracy"]) == 1.0
    assert losses[-1] < 0.05 < losses[0]
