"""RewardModel behaviour without torch: packing, shared-prompt branches, dtypes, remat, dropout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_fixtures import EOS, pad_rows, random_rows, scrambled_model, tiny_config
from rewardax.errors import ConfigError
from rewardax.models import ModelConfig, RewardModel, RewardOutput, transformer
from rewardax.models.kernels import select_kernels
from rewardax.models.transformer import embed_rows, remat_fallback


def _plain_rewards(model, rows):
    ids, mask = pad_rows(rows, "right")
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_packed_rows_equal_unpacked(arch):
    model = scrambled_model(arch)
    a, b = random_rows(3, [5, 7])
    expected = _plain_rewards(model, [a, b])[:, 0]
    pad = 2
    ids = jnp.asarray([[*a, *b, *([EOS] * pad)]])
    segments = jnp.asarray([[1] * len(a) + [2] * len(b) + [0] * pad])
    positions = jnp.asarray([[*range(len(a)), *range(len(b)), *([0] * pad)]])
    ends = jnp.asarray([[len(a) - 1, len(a) + len(b) - 1]])
    out = model(
        ids, segments != 0, positions=positions, segment_ids=segments, reward_positions=ends
    )
    assert out.logits.shape == (1, 2, 1)
    np.testing.assert_allclose(np.asarray(out.logits[0, :, 0]), expected, atol=1e-5, rtol=0)
    # Guard: without segment ids the second sequence sees the first and its reward changes.
    leaky = model(ids, segments != 0, positions=positions, reward_positions=ends)
    assert abs(float(leaky.logits[0, 1, 0]) - expected[1]) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_shared_prompt_branches_equal_two_sequences(arch):
    model = scrambled_model(arch)
    prompt, r1, r2 = random_rows(4, [4, 3, 5])
    expected = _plain_rewards(model, [prompt + r1, prompt + r2])[:, 0]
    p, n1, n2 = len(prompt), len(r1), len(r2)
    ids = jnp.asarray([prompt + r1 + r2])
    branches = jnp.asarray([[0] * p + [1] * n1 + [2] * n2])
    # Branch 2's positions continue from the prompt's end, not from branch 1's.
    positions = jnp.asarray([[*range(p + n1), *range(p, p + n2)]])
    ends = jnp.asarray([[p + n1 - 1, p + n1 + n2 - 1]])
    out = model(ids, positions=positions, branch_ids=branches, reward_positions=ends)
    np.testing.assert_allclose(np.asarray(out.logits[0, :, 0]), expected, atol=1e-5, rtol=0)
    leaky = model(ids, positions=positions, reward_positions=ends)  # branch 2 sees branch 1
    assert abs(float(leaky.logits[0, 1, 0]) - expected[1]) > 1e-3


def test_padding_rows_and_positions_defaults():
    model = scrambled_model("llama")
    rows = random_rows(5, [6, 2])
    ids, mask = pad_rows(rows, "left")
    mask[1] = 0  # an all-padding row must not produce NaN anywhere
    out = model(jnp.asarray(ids), jnp.asarray(mask), output_hidden_states=True)
    assert np.isfinite(np.asarray(out.logits)).all()
    assert np.isfinite(np.asarray(out.hidden_states)).all()
    assert isinstance(out, RewardOutput) and out.hidden_states.shape == (2, 6, 64)
    # reward_positions [N] selects per row; the default is the last mask==1 index.
    explicit = model(jnp.asarray(ids), jnp.asarray(mask), reward_positions=jnp.asarray([5, 5]))
    np.testing.assert_array_equal(np.asarray(explicit.logits[0]), np.asarray(out.logits[0]))


def test_jit_and_output_is_a_pytree():
    model = scrambled_model("qwen2")
    ids, mask = pad_rows(random_rows(6, [4, 6]), "right")

    @nnx.jit
    def run(m, ids, mask):
        return m(ids, mask)

    out = run(model, jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(
        np.asarray(out.logits), _plain_rewards(model, random_rows(6, [4, 6])), atol=1e-4
    )


def test_bfloat16_compute_close_to_float32():
    f32 = scrambled_model("llama")
    bf16 = scrambled_model("llama", dtype="bfloat16")  # same f32 params, bf16 activations
    ids, mask = pad_rows(random_rows(7, list(range(4, 20))), "left")
    ref = np.asarray(f32(jnp.asarray(ids), jnp.asarray(mask)).logits)
    out = bf16(jnp.asarray(ids), jnp.asarray(mask), output_hidden_states=True)
    assert out.logits.dtype == jnp.float32 and out.hidden_states.dtype == jnp.bfloat16
    _assert_within_bf16_budget(np.asarray(out.logits), ref)


def _assert_within_bf16_budget(got: np.ndarray, ref: np.ndarray) -> None:
    """Rewards computed with bf16 roundings vs float32 ones, from the 2-layer scrambled model.

    Tolerance: bf16 keeps 8 significant bits (unit roundoff 2^-8 ~ 0.4%). Activations are
    rounded at ~10 matmul inputs in these 2 layers; independent roundings add up like a random
    walk, sqrt(10) * 0.4% ~ 1.3% relative error in the final hidden states (measured: 1.5%;
    these deliberately large random weights amplify more than trained ones). A reward sums
    64 such features with random signs, so its relative error is about the same (measured
    2.1% RMS, 4.2% worst of 16 rows). We allow 5% RMS and 10% worst case of the rewards' RMS:
    ~2.5x the measurement, while a layout or dtype bug gives errors of order 100%.
    """
    rms = float(np.sqrt(np.mean(ref**2)))
    err = np.abs(got - ref)
    assert float(np.sqrt(np.mean(err**2))) < 0.05 * rms, (err, rms)
    assert float(err.max()) < 0.10 * rms, (err, rms)
    assert err.max() > 0  # it really computed in bf16


def test_bfloat16_params_close_to_float32():
    """bf16 parameters and activations against a float32 model holding the same (bf16-rounded)
    parameters, so only the compute rounding differs: within `_assert_within_bf16_budget`
    (5% RMS, 10% worst row of the rewards' RMS; measured 1.0% and 2.3% for this qwen3). Against
    the float32 parameters before rounding the same budget holds (measured 1.5% and 3.0%)."""
    bf16 = scrambled_model("qwen3", dtype="bfloat16", param_dtype="bfloat16")
    assert bf16.score.kernel[...].dtype == jnp.bfloat16
    unrounded = scrambled_model("qwen3")  # the same float32 noise, before the bf16 cast
    rounded = scrambled_model("qwen3")
    upcast = jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(bf16, nnx.Param))
    nnx.update(rounded, upcast)
    ids, mask = pad_rows(random_rows(8, list(range(4, 20))), "left")
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    out = bf16(ids, mask)
    assert out.logits.dtype == jnp.float32
    _assert_within_bf16_budget(np.asarray(out.logits), np.asarray(rounded(ids, mask).logits))
    _assert_within_bf16_budget(np.asarray(out.logits), np.asarray(unrounded(ids, mask).logits))


def test_remat_policies_give_the_same_gradients():
    ids, mask = pad_rows(random_rows(9, [6, 4]), "right")
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def grads(policy):
        model = scrambled_model("llama", remat_policy=policy)
        g = nnx.grad(lambda m: m(ids, mask).logits.sum())(model)
        return jax.tree.leaves(g)

    ref = grads("none")
    # Recomputation inside the scanned layers lets XLA fuse (and so round) differently: float32
    # noise of order 1e-5 on gradients of order 1; a wrong policy gives errors of order 1.
    for policy in (
        "full",
        "save_dots",
        "save_attention",
        "save_attention_mlp",
        "offload_attention",
    ):
        for a, b in zip(ref, grads(policy), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_dropout_only_when_asked():
    ids = jnp.asarray(random_rows(10, [8]))
    plain = scrambled_model("llama")
    drop = scrambled_model("llama", dropout_rate=0.3)
    same = np.asarray(drop(ids).logits)  # deterministic=True by default
    np.testing.assert_allclose(same, np.asarray(plain(ids).logits), atol=1e-6)
    a = np.asarray(drop(ids, deterministic=False, dropout_rng=jax.random.key(1)).logits)
    b = np.asarray(drop(ids, deterministic=False, dropout_rng=jax.random.key(2)).logits)
    assert np.abs(a - same).max() > 1e-4 and np.abs(a - b).max() > 1e-4
    with pytest.raises(ConfigError, match="dropout_rng"):  # active dropout needs a key
        drop(ids, deterministic=False)
    # dropout_rate=0 with deterministic=False is still the plain model.
    np.testing.assert_allclose(np.asarray(plain(ids, deterministic=False).logits), same, atol=1e-6)


def test_score_head_init_and_logical_axes():
    config = tiny_config("llama", num_labels=8)
    model = RewardModel(config, rngs=nnx.Rngs(0))
    std = float(np.std(np.asarray(model.score.kernel[...])))
    assert abs(std - 1 / np.sqrt(65)) < 0.15 / np.sqrt(65)
    spec = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    layer = spec["model"]["layers"]  # stacked: every name gains the leading `layers` axis
    assert tuple(spec["model"]["embed_tokens"]["embedding"].get_value()) == ("vocab", "embed")
    assert tuple(layer["self_attn"]["q_proj"]["kernel"].get_value()) == (
        "layers",
        "embed",
        "heads",
        "head_dim",
    )
    assert tuple(layer["self_attn"]["k_proj"]["kernel"].get_value()) == (
        "layers",
        "embed",
        "kv_heads",
        "head_dim",
    )
    assert tuple(layer["mlp"]["down_proj"]["kernel"].get_value()) == ("layers", "mlp", "embed")


def test_bad_options_raise_rewardax_errors():
    with pytest.raises(ConfigError, match="remat_policy"):
        RewardModel(tiny_config("llama"), remat_policy="dots", rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="dtype"):
        RewardModel(tiny_config("llama"), dtype="int8", rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="matmul_dtype"):
        RewardModel(tiny_config("llama"), matmul_dtype="int8", rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="supported architectures: llama, mistral"):
        ModelConfig(architecture="gpt2")
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        tiny_config("llama", num_key_value_heads=3)
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn'"):
        tiny_config("llama", rope_scaling={"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("policy", ["none", "full"])
def test_explicit_dropout_key_is_reproducible(policy):
    ids = jnp.asarray(random_rows(14, [8, 8]))
    model = scrambled_model("llama", dropout_rate=0.3, remat_policy=policy)
    plain = np.asarray(model(ids).logits)

    @nnx.jit
    def train_logits(m, ids, key):
        return m(ids, deterministic=False, dropout_rng=key).logits

    a = np.asarray(train_logits(model, ids, jax.random.key(1)))
    b = np.asarray(train_logits(model, ids, jax.random.key(1)))
    c = np.asarray(train_logits(model, ids, jax.random.key(2)))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-4 and np.abs(a - plain).max() > 1e-4


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_config_survives_hf_dict_round_trip(arch):
    config = tiny_config(arch, num_labels=3)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    causal = config.to_hf_dict(for_sequence_classification=False)
    assert causal["architectures"][0].endswith("ForCausalLM") and "num_labels" not in causal


def test_sharding_table_places_every_parameter():
    """The project's one logical->mesh table knows every logical name the model uses."""
    from rewardax.sharding import LOGICAL_AXIS_RULES

    model = RewardModel(tiny_config("qwen3"), rngs=nnx.Rngs(0))
    names = set()
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var.get_value().ndim
        names.update(a for a in axes if a is not None)
    assert names <= set(LOGICAL_AXIS_RULES), names - set(LOGICAL_AXIS_RULES)


def test_swiglu_hand_written_backward_equals_autodiff():
    """The MLP's custom VJP (it keeps only gate and up for the backward) must give autodiff's
    gradients of silu(gate) * up, including far in both tails of the sigmoid."""
    from rewardax.models.transformer import swiglu

    keys = jax.random.split(jax.random.key(3), 3)
    gate = jax.random.normal(keys[0], (4, 7, 16)) * 4.0
    gate = gate.at[0, 0, :4].set(jnp.array([-60.0, -20.0, 20.0, 60.0]))
    up = jax.random.normal(keys[1], (4, 7, 16))
    weights = jax.random.normal(keys[2], (4, 7, 16))

    def ours(g, u):
        return jnp.sum(weights * swiglu(g, u))

    def reference(g, u):
        return jnp.sum(weights * (jax.nn.silu(g) * u))

    np.testing.assert_allclose(ours(gate, up), reference(gate, up), rtol=1e-6)
    got = jax.grad(ours, argnums=(0, 1))(gate, up)
    want = jax.grad(reference, argnums=(0, 1))(gate, up)
    for g, w in zip(got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(g)))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # The gate gradient is not the up gradient nor zero: a swapped or dropped term would pass a
    # loose check on the loss alone.
    assert float(jnp.max(jnp.abs(got[0] - got[1]))) > 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_rotation_as_a_product_equals_the_two_halves(dtype):
    """`Kernels.rope_matmul` (the TPU's formulation) rotates by a product with a [D, D] matrix
    of 0 and +-1: the same values as the slices-and-concatenation form, exactly (each output
    takes one input, at the highest precision), for both halves of the head; the same float32
    gradients, and bf16 gradients within one bf16 step."""
    from rewardax.models.transformer import apply_rope, rope_cos_sin, rope_inverse_frequencies

    config = tiny_config("llama")
    d = config.resolved_head_dim
    keys = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(keys[0], (2, 9, 3, d)).astype(dtype)
    cotangent = jax.random.normal(keys[1], x.shape)
    positions = jnp.broadcast_to(jnp.arange(9) * 37, (2, 9))
    cos, sin = rope_cos_sin(positions, *rope_inverse_frequencies(config))

    def loss(x, by_matmul):
        return jnp.sum(cotangent * apply_rope(x, cos, sin, by_matmul).astype(jnp.float32))

    want, got = (apply_rope(x, cos, sin, by_matmul) for by_matmul in (False, True))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    grads = [np.asarray(jax.grad(loss)(x, m), np.float32) for m in (False, True)]
    if dtype == "float32":
        np.testing.assert_array_equal(grads[1], grads[0])
    else:
        # The product's backward takes the cotangent in x's dtype: its rotated term is rounded
        # to bf16 once before the sum is, so the two differ by at most one bf16 step (2^-7
        # relative).
        step = np.maximum(np.abs(grads[0]), 1.0) * 2.0**-7
        assert np.all(np.abs(grads[1] - grads[0]) <= step)
        assert np.mean(grads[1] == grads[0]) > 0.5
    # A rotation that did nothing, or rotated one half only, would differ from x * cos there.
    plain = x.astype(jnp.float32) * cos[:, :, None, :]
    half = d // 2
    for part in (slice(None, half), slice(half, None)):
        assert float(jnp.max(jnp.abs(got[..., part].astype(jnp.float32) - plain[..., part]))) > 0.1


def test_scanned_layers_equal_unrolled_layers(monkeypatch):
    """Decoders of at most UNROLLED_MAX_LAYERS layers run them unrolled, deeper ones as a scan:
    the two programs must give the same rewards and gradients (the tiny test models take the
    unrolled path, so the scan is checked here), with dropout's per-layer keys too."""
    import rewardax.models.transformer as transformer

    model = scrambled_model("llama", dropout_rate=0.3)
    assert model.config.num_hidden_layers <= transformer.UNROLLED_MAX_LAYERS
    ids, mask = map(jnp.asarray, pad_rows(random_rows(5, [12, 7]), "right"))
    key = jax.random.key(3)

    def run():
        def loss(m):
            out = m(ids, mask, deterministic=False, dropout_rng=key)
            return jnp.sum(out.logits**2), out.logits

        (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return logits, jax.tree.leaves(nnx.state(grads, nnx.Param))

    unrolled, unrolled_grads = run()
    monkeypatch.setattr(transformer, "UNROLLED_MAX_LAYERS", 0)
    scanned, scanned_grads = run()
    assert not np.allclose(unrolled, 0.0)
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=1e-5)
    for a, b in zip(scanned_grads, unrolled_grads, strict=True):
        scale = float(np.max(np.abs(b))) + 1e-12
        np.testing.assert_allclose(a / scale, b / scale, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("side", ["right", "left"])
def test_query_blocks_equal_one_block(monkeypatch, side):
    """Rows longer than ATTENTION_QUERY_BLOCK are attended block by block, each block against the
    keys up to its last query only: rewards, hidden states and gradients must equal the one-block
    computation (block sizes that do not divide the row length included)."""
    import rewardax.models.transformer as transformer

    model = scrambled_model("mistral")  # sliding window 4: the mask is more than causal
    ids, mask = map(jnp.asarray, pad_rows(random_rows(7, [37, 22, 9]), side))

    def run():
        def loss(m):
            out = m(ids, mask, output_hidden_states=True)
            return jnp.sum(out.logits**2), out

        (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return out, jax.tree.leaves(nnx.state(grads, nnx.Param))

    whole, whole_grads = run()
    for block in (8, 13):
        monkeypatch.setattr(transformer, "ATTENTION_QUERY_BLOCK", block)
        blocked, blocked_grads = run()
        np.testing.assert_allclose(blocked.logits, whole.logits, atol=1e-5, rtol=0)
        np.testing.assert_allclose(blocked.hidden_states, whole.hidden_states, atol=1e-5, rtol=0)
        for g, w in zip(blocked_grads, whole_grads, strict=True):
            # Float32 sums in another order: compare relative to each gradient's scale.
            scale = float(np.max(np.abs(w))) + 1e-12
            np.testing.assert_allclose(g / scale, w / scale, atol=1e-5, rtol=0)


def test_mixed_matmul_float32_equals_autodiff_of_dot():
    """The hand-written backward of `mixed_matmul` (with the physical transpose of x for the
    weight gradient, and the odd-width fallback) against autodiff of a plain dot."""
    from rewardax.models.transformer import _physical_transpose, mixed_matmul

    for k in (6, 7):  # even: the [M, K/2, 2] transpose; odd: the dot_general fallback
        kx, kw, kg = jax.random.split(jax.random.key(k), 3)
        x = jax.random.normal(kx, (5, k))
        w = jax.random.normal(kw, (k, 3))
        g = jax.random.normal(kg, (5, 3))
        if k % 2 == 0:
            np.testing.assert_array_equal(np.asarray(_physical_transpose(x)), np.asarray(x).T)
        else:
            assert _physical_transpose(x) is None
        y, vjp = jax.vjp(lambda a, b: mixed_matmul(a, b, jnp.float32), x, w)
        y_ref, vjp_ref = jax.vjp(jnp.dot, x, w)
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
        for got, ref in zip(vjp(g), vjp_ref(g), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_mixed_matmuls_of_one_input_equal_autodiff_of_separate_dots():
    """`mixed_matmuls` (one cast copy of x for q/k/v or gate/up): the input gradient sums every
    kernel's term, each kernel gets its own weight gradient, and an output whose cotangent is
    zero contributes nothing."""
    from rewardax.models.transformer import mixed_matmuls

    with jax.default_matmul_precision("highest"):  # float32 products on every backend
        _check_mixed_matmuls(mixed_matmuls)


def _check_mixed_matmuls(mixed_matmuls) -> None:
    for k in (6, 7):
        keys = jax.random.split(jax.random.key(10 + k), 7)
        x = jax.random.normal(keys[0], (5, k))
        ws = tuple(jax.random.normal(keys[1 + i], (k, n)) for i, n in enumerate((3, 2, 4)))
        gs = tuple(jax.random.normal(keys[4 + i], (5, w.shape[1])) for i, w in enumerate(ws))
        gs = (gs[0], jnp.zeros_like(gs[1]), gs[2])
        ys, vjp = jax.vjp(lambda a, b: mixed_matmuls(a, b, jnp.float32), x, ws)
        ys_ref, vjp_ref = jax.vjp(lambda a, b: tuple(jnp.dot(a, w) for w in b), x, ws)
        for y, y_ref in zip(ys, ys_ref, strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
        (gx, gws), (gx_ref, gws_ref) = vjp(gs), vjp_ref(gs)
        np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-5, atol=1e-5)
        # Against the hand-computed sum of the three terms too.
        by_hand = sum(np.asarray(g) @ np.asarray(w).T for g, w in zip(gs, ws, strict=True))
        np.testing.assert_allclose(np.asarray(gx), by_hand, rtol=1e-5, atol=1e-5)
        for got, ref in zip(gws, gws_ref, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(gws[1]), 0.0)


def test_bfloat16_matmuls_with_float32_activations():
    ids, mask = pad_rows(random_rows(7, list(range(4, 20))), "left")
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    f32 = scrambled_model("llama")
    mixed = scrambled_model("llama", matmul_dtype="bfloat16")  # same params (same seed)
    assert mixed.model.layers.mlp.up_proj.matmul_dtype == jnp.bfloat16
    out = mixed(ids, mask, output_hidden_states=True)
    assert out.hidden_states.dtype == jnp.float32  # activations stay float32
    # Only the matmul inputs are rounded to bf16 (~10 per layer): the same budget as bf16 compute.
    _assert_within_bf16_budget(np.asarray(out.logits), np.asarray(f32(ids, mask).logits))

    def grads(model):
        g = nnx.grad(lambda m: m(ids, mask).logits.sum())(model)
        return jax.tree.leaves(nnx.state(g, nnx.Param))

    # Gradients come out in the parameters' dtype, close to float32's: rounding g, x and W to
    # bf16 in each backward matmul gives ~1-3% relative error per tensor (measured 1.6% median,
    # 3.5% worst on SmolLM2); a wrong transpose or a missing term gives ~100%.
    for a, b in zip(grads(f32), grads(mixed), strict=True):
        assert b.dtype == jnp.float32
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
        assert rel < 0.08, rel


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="reads XLA:CPU's compiled HLO; another backend's compiler lays out and fuses dots "
    "its own way, so the count and the operand types say nothing there",
)
def test_bfloat16_weight_gradient_stays_a_bf16_dot():
    """Regression guard for the physical transpose, specific to XLA:CPU (skipped elsewhere): the
    CPU compiler must see bf16 operands in every dot of the backward pass (a folded transpose
    made it upcast the weight gradient to float32). It counts dots in the text of the compiled
    HLO, which is a property of one compiler: TPU and GPU compilers fuse and convert differently
    and a bf16-vs-f32 operand there is neither a bug nor a guarantee."""
    import re

    from rewardax.models.transformer import mixed_matmul

    x = jnp.ones((64, 32), jnp.float32)
    w = jnp.ones((32, 48), jnp.float32)

    def loss(x, w):
        return jnp.sum(mixed_matmul(x, w, jnp.bfloat16) ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    dots = re.findall(r"\bdot\((%[\w.\-]+), (%[\w.\-]+)\)", hlo)
    assert len(dots) == 3, hlo
    for operands in dots:
        for name in operands:
            kind = re.search(rf"{re.escape(name)} = (\w+)\[", hlo).group(1)
            assert kind == "bf16", (name, kind)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_backward_equals_autodiff_of_softmax_attention(dtype):
    """`attend`'s written-out backward against autodiff of a plain masked softmax attention:
    grouped queries (G = 3), a row whose first queries see no key (their output and gradients
    are zero), and bf16 inputs (float32 scores either way)."""
    from rewardax.models.transformer import attend

    n, kh, g, t, s, d = 2, 2, 3, 5, 7, 4
    keys = jax.random.split(jax.random.key(3), 5)
    q, k, v = (
        jax.random.normal(key, shape).astype(dtype)
        for key, shape in zip(
            keys[:3], [(n, kh, g, t, d), (n, kh, s, d), (n, kh, s, d)], strict=True
        )
    )
    mask = jax.random.bernoulli(keys[3], 0.6, (n, t, s)).at[1, :2].set(False)
    mask = mask.at[0, :, 0].set(True)
    w = jax.random.normal(keys[4], (n, kh, g, t, d))
    scale = 0.5

    def reference(q, k, v):
        scores = jnp.einsum("nkgtd,nksd->nkgts", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, None, None], scores * scale, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(mask[:, None, None], probs, 0.0)  # rows with no key: 0, not NaN
        return jnp.einsum("nkgts,nksd->nkgtd", probs, v.astype(jnp.float32))

    def loss(f):
        return jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))

    with jax.default_matmul_precision("highest"):  # float32 products on every backend
        got, got_grads = loss(lambda q, k, v: attend(q, k, v, mask, scale))(q, k, v)
        want, want_grads = loss(reference)(q, k, v)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol)
    out = attend(q, k, v, mask, scale)
    np.testing.assert_array_equal(np.asarray(out[1, :, :, :2]), 0.0)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert a.dtype == jnp.dtype(dtype)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a / np.abs(b).max(), b / np.abs(b).max(), atol=tol, rtol=0)
    np.testing.assert_array_equal(np.asarray(got_grads[0], np.float32)[1, :, :, :2], 0.0)


def test_export_writes_column_major_host_arrays_in_their_logical_order(tmp_path, monkeypatch):
    # On a TPU v5e `jax.device_get` returned the [49152, 32] token embedding column-major
    # (strides (4, 196608)) and safetensors wrote its memory as it lay: the reloaded embedding was
    # the transposed bytes (rewards off by up to 0.19). Every parameter fetched column-major here.
    from rewardax.models import AutoRewardModel, hf

    model = scrambled_model("llama")
    real_get = jax.device_get
    monkeypatch.setattr(hf.jax, "device_get", lambda x: np.asfortranarray(real_get(x)))
    out = model.save_pretrained(tmp_path / "rm")
    monkeypatch.undo()
    again = AutoRewardModel.from_pretrained(out)
    before = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    after = dict(nnx.to_flat_state(nnx.state(again, nnx.Param)))
    assert before.keys() == after.keys()
    for path, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[path][...]), np.asarray(value[...]), path)


def test_remat_fallback_names_why_a_residual_policy_acts_as_full():
    splash = select_kernels("pallas", "tpu")
    assert remat_fallback("save_attention", splash) is None  # every layout runs splash
    assert remat_fallback("offload_attention", "pallas") is None
    assert remat_fallback("full", "cpu") is None
    assert "cpu_blocked" in remat_fallback("offload_attention", select_kernels("cpu", "cpu"))
    assert "xla" in remat_fallback("save_attention", "xla")


def test_embedding_gradients_of_a_repeated_token_are_summed_in_float32():
    """bf16 compute from float32 parameters: a token read ~1333 times in a batch gets the float32
    sum of its rows' gradients (`transformer.embed_rows`), not a bf16 one. Control: autodiff of
    `nnx.Embed`, which casts the table to bf16 before the lookup: XLA:CPU sums in bf16, XLA:TPU
    in float32 but rounds the sum to bf16 (v5e: 2.0e-3 off, benchmarks/bf16_gradient_sums.py)."""
    vocab, width, n = 16, 8, 4000
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(vocab, width)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, 3, size=(n,)))  # three tokens, each ~1333 times
    weights = jnp.asarray(rng.normal(size=(n, width))).astype(jnp.bfloat16)
    reference = np.zeros((vocab, width))
    np.add.at(reference, np.asarray(ids), np.asarray(weights, np.float64))

    def loss(rows):
        return jnp.sum(rows.astype(jnp.bfloat16).astype(jnp.float32) * weights)

    grad = jax.grad(lambda t: loss(embed_rows(t, ids)))(table)
    assert grad.dtype == jnp.float32
    scale = np.abs(reference).max()
    np.testing.assert_allclose(grad, reference, rtol=0, atol=1e-6 * scale)
    np.testing.assert_array_equal(embed_rows(table, ids), table[ids])

    embed = nnx.Embed(vocab, width, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(embed)
    state["embedding"].set_value(table)
    control = jax.grad(lambda st: loss(nnx.merge(graphdef, st)(ids)))(state)["embedding"][...]
    control_error = np.abs(np.asarray(control) - reference).max()
    assert control_error > (1e-2 if jax.default_backend() == "cpu" else 1e-4) * scale

    # float32 all the way: the same bits as autodiff of the lookup.
    plain = jax.grad(lambda t: loss(jnp.take(t, ids, axis=0)))(table)
    np.testing.assert_array_equal(grad, plain)
    # A bf16 table gets its float32 sum rounded once to bf16.
    g16 = jax.grad(lambda t: loss(embed_rows(t, ids)))(table.astype(jnp.bfloat16))
    assert g16.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(g16, np.float64), reference, rtol=2**-8, atol=1e-6 * scale
    )


def test_the_decoder_looks_its_tokens_up_through_embed_rows(monkeypatch):
    calls = []

    def spy(table, ids):
        calls.append((table.dtype, ids.shape))
        return embed_rows(table, ids)

    monkeypatch.setattr(transformer, "embed_rows", spy)
    model = RewardModel(tiny_config("llama"), dtype="bfloat16", rngs=nnx.Rngs(0))
    model(jnp.ones((2, 5), jnp.int32))
    assert calls == [(jnp.float32, (2, 5))]


@pytest.mark.parametrize("float32_sums", [True, False])
def test_norm_weight_and_bias_gradients_are_summed_in_float32_under_bf16_compute(float32_sums):
    """A norm's weight and a projection's bias get gradients summed over every token (here 16384):
    with bf16 activations they are summed in float32 and rounded once to the bf16 copy of the
    parameter. With `Kernels.float32_sums` the model asks for that (`RMSNorm`, `add_bias`);
    without, the sum is the compiler's: XLA:TPU sums in float32 (the same tolerance holds, that
    is why a TPU's kernels leave it off), XLA:CPU in bf16 (more than 1e-2 off, the control)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 2048, 64)), jnp.bfloat16)
    weights = jnp.asarray(rng.normal(size=(8, 2048, 64)), jnp.bfloat16)
    kernels = dataclasses.replace(select_kernels("cpu", "cpu"), float32_sums=float32_sums)
    summed_in_float32 = float32_sums or jax.default_backend() == "tpu"

    def weight_grad(module):
        graphdef, state = nnx.split(module)
        loss = lambda st: jnp.sum(  # noqa: E731
            (nnx.merge(graphdef, st)(x, kernels) * weights).astype(jnp.float32)
        )
        return jax.grad(loss)(state)

    def check(grad, reference, atol):
        error = np.abs(grad - reference).max() / np.abs(reference).max()
        assert error < atol if summed_in_float32 else error > 1e-2

    norm = transformer.RMSNorm(64, 1e-6, names=("norm",), param_dtype=jnp.float32)
    grad = np.asarray(weight_grad(norm)["weight"][...], np.float64)
    x64 = np.asarray(x, np.float64)
    normed = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6)
    normed = np.asarray(jnp.asarray(normed, jnp.float32).astype(jnp.bfloat16), np.float64)
    reference = np.sum(normed * np.asarray(weights, np.float64), axis=(0, 1))
    check(grad, reference, 5e-3)  # float32 sums: 2.4e-3 on XLA:CPU (a bf16 sum: 2.1e-2)

    proj = transformer.Projection(
        (64,),
        (64,),
        ("embed", "mlp"),
        use_bias=True,
        std=0.02,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    grad = np.asarray(weight_grad(proj)["bias"][...], np.float64)
    reference = np.sum(np.asarray(weights, np.float64), axis=(0, 1))  # d(sum(y * w)) / d bias
    check(grad, reference, 3e-3)  # float32 sums: 1.6e-3 on XLA:CPU (a bf16 sum: 1.8e-2)
