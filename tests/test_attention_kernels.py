"""The backend's kernels (`rewardax.models.kernels`) against the CPU formulation.

Splash attention (`models.pallas_attention`) runs here in Pallas' interpret mode, so CI checks the
very kernel a TPU compiles, on every layout it takes: causal, grouped-query heads, right and left
padding, packed rows (segment ids), the shared-prompt tree and sliding windows (a dynamic mask),
rows whose length is not a multiple of the tile, head width 64.
Reference: `transformer.attend` (today's CPU attention) on `transformer.attention_mask`.
Tolerances: float32 inputs 1e-5 (forward and gradients, absolute, on values of order 1); bfloat16
inputs 2e-2 relative to the largest magnitude (both sides round the probabilities to bf16, in a
different order). Tests that need a TPU are skipped elsewhere with the reason.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rewardax.errors import ConfigError
from rewardax.models import ModelConfig, RewardModel
from rewardax.models.kernels import (
    ATTENTION_RESIDUALS,
    select_kernels,
    traced_under,
    xla_attention,
)
from rewardax.models.kernels import FLASH_TILES as TPU_FLASH_TILES
from rewardax.models.pallas_attention import splash_attention
from rewardax.models.transformer import attend, attention_mask

ON_TPU = jax.default_backend() == "tpu"
needs_tpu = pytest.mark.skipif(not ON_TPU, reason="compiles the splash kernel for a TPU chip")


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """float32 products in float32 on every backend (a TPU's default is bf16 passes)."""
    with jax.default_matmul_precision("highest"):
        yield


N, H, K, D = 2, 4, 2, 64  # grouped queries: 2 query heads per key/value head; Qwen's width 64


def _segments(layout: str, t: int) -> np.ndarray:
    """int [N, T] segment ids: 0 = padding."""
    if layout == "full":
        return np.ones((N, t), np.int32)
    if layout == "right_padded":
        return np.array([[1] * (t - 37) + [0] * 37, [1] * (t // 3) + [0] * (t - t // 3)])
    if layout == "left_padded":
        return np.array([[0] * 37 + [1] * (t - 37), [0] * (t - 5) + [1] * 5])
    # Packed: several segments per row, then padding.
    a, b = t // 3, t // 2
    return np.array([[1] * a + [2] * b + [0] * (t - a - b), [1] * 10 + [2] * (t - 10)])


def _inputs(t: int, dtype, seed: int = 0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(N, t, H, D)), dtype)
    k = jnp.asarray(r.normal(size=(N, t, K, D)), dtype)
    v = jnp.asarray(r.normal(size=(N, t, K, D)), dtype)
    cotangent = jnp.asarray(r.normal(size=(N, t, H, D)), jnp.float32)
    return q, k, v, cotangent


def _reference(q, k, v, segment_ids, scale):
    """`transformer.attend` on [N, T, H, D] inputs -> float32 [N, T, H, D]."""
    n, t, h, d = q.shape
    kv = k.shape[2]
    positions = jnp.maximum(jnp.cumsum(segment_ids != 0, axis=-1) - 1, 0)
    mask = attention_mask(jnp.asarray(segment_ids), positions)
    qh = q.reshape(n, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    out = attend(qh, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, scale)
    return out.transpose(0, 3, 1, 2, 4).reshape(n, t, h, d)


def _value_and_grads(fn, q, k, v, cotangent):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

    out = fn(q, k, v).astype(jnp.float32)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return [out, *(g.astype(jnp.float32) for g in grads)]


# float32 on CPU: 1e-5. On a TPU v5e the kernel's float32 dq differed from the reference by up to
# 1.1e-4 (absolute and relative; 2026-12-05, benchmarks/tpu_run.sh): the chip's float32 passes.
F32_TOLERANCE = 2e-4 if ON_TPU else 1e-5
# The whole model's float32 rewards and gradients: on the v5e, up to 8.7e-5 apart (same run);
# in a later run one gradient of a packed model, 0.0423 in an array whose largest is 35.7, was
# 4.0e-4 off: on a TPU the absolute bound scales with the array's largest magnitude.
MODEL_ATOL, MODEL_RTOL = (2e-4, 1e-3) if ON_TPU else (2e-5, 1e-4)


def _assert_close(got, want, dtype):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if dtype == jnp.float32:
            np.testing.assert_allclose(a, b, atol=F32_TOLERANCE, rtol=F32_TOLERANCE, err_msg=name)
        else:
            bound = 2e-2 * max(1.0, float(np.abs(b).max()))
            assert np.abs(a - b).max() <= bound, (name, np.abs(a - b).max(), bound)


@pytest.mark.parametrize("layout", ["full", "right_padded", "left_padded", "packed"])
@pytest.mark.parametrize("t", [256, 200])  # 200: padded to the 128-token tile inside
def test_splash_attention_matches_cpu_attention_float32(layout, t):
    q, k, v, cot = _inputs(t, jnp.float32)
    seg = jnp.asarray(_segments(layout, t))
    scale = 1.0 / np.sqrt(D)
    got = _value_and_grads(
        lambda q, k, v: splash_attention(
            q, k, v, seg, scale, block_q=128, block_kv=128, interpret=True
        ),
        q,
        k,
        v,
        cot,
    )
    want = _value_and_grads(lambda q, k, v: _reference(q, k, v, seg, scale), q, k, v, cot)
    _assert_close(got, want, jnp.float32)
    # Padding queries get zeros, as in the CPU attention.
    assert np.all(np.asarray(got[0])[np.asarray(seg) == 0] == 0)


# rewardax's own kernel: several query and key tiles a row, forward and backward tiles of
# different shapes (the causal skip and the clamped tile fetches in both directions); 384
# tokens are padded to 512 inside.
# rewardax's flash kernels' tiles here: forward query tile and key chunk, backward query chunk
# and key tile (unequal, so that a tile mix-up shows).
FLASH_TILES = (128, 256, 256, 128)
# Square tiles: the diagonal's blocks run as steps that leave out their all-masked quarter
# (`flash_attention._split_diagonal`, here down to halves of 128): 256, split once; 512, twice.
SPLIT_TILES = (256, 256, 256, 256)
SPLIT_TWICE_TILES = (512, 512, 512, 512)


# scale: 1/8 (1/sqrt(D)) puts the scale on the backward's key tiles, 0.1 (not a power of two)
# on its queries (`flash_attention._backward_kernel`).
@pytest.mark.parametrize(
    "layout, dtype, tiles, scale",
    [
        pytest.param("full", jnp.float32, FLASH_TILES, 0.125, marks=pytest.mark.slow),
        pytest.param("right_padded", jnp.float32, FLASH_TILES, 0.125, marks=pytest.mark.slow),
        pytest.param("left_padded", jnp.float32, FLASH_TILES, 0.125, marks=pytest.mark.slow),
        pytest.param("packed", jnp.float32, FLASH_TILES, 0.1, marks=pytest.mark.slow),
        ("packed", jnp.bfloat16, FLASH_TILES, 0.125),
        ("packed", jnp.float32, SPLIT_TILES, 0.1),
        pytest.param("right_padded", jnp.bfloat16, SPLIT_TILES, 0.125, marks=pytest.mark.slow),
        pytest.param("packed", jnp.bfloat16, SPLIT_TWICE_TILES, 0.125, marks=pytest.mark.slow),
    ],
)
def test_flash_attention_matches_cpu_attention(layout, dtype, tiles, scale, monkeypatch):
    from rewardax.models import flash_attention

    monkeypatch.setattr(flash_attention, "_SPLIT_MIN_HALF", 128)
    t = 384 if max(tiles) <= 256 else 1024
    q, k, v, cot = _inputs(t, dtype, seed=4)
    seg = jnp.asarray(_segments(layout, t))
    got = _value_and_grads(
        lambda q, k, v: splash_attention(q, k, v, seg, scale, interpret=True, flash=tiles),
        q,
        k,
        v,
        cot,
    )
    want = _value_and_grads(
        lambda q, k, v: _reference(q, k, v, seg, scale),
        *(a.astype(jnp.float32) for a in (q, k, v)),
        cot,
    )
    _assert_close(got, want, dtype)
    assert np.all(np.asarray(got[0])[np.asarray(seg) == 0] == 0)


@pytest.mark.slow
def test_flash_attention_leaves_the_tree_mask_to_splash():
    """Branch ids (and windows) need splash's dynamic mask: with flash's tiles the same values as
    splash there."""
    t = 256
    q, k, v, cot = _inputs(t, jnp.float32, seed=5)
    segment, branch, _ = _tree_ids(t)
    seg, branch = jnp.asarray(segment), jnp.asarray(branch)
    scale = 1.0 / np.sqrt(D)
    results = [
        _value_and_grads(
            lambda q, k, v, flash=flash: splash_attention(
                q,
                k,
                v,
                seg,
                scale,
                block_q=128,
                block_kv=128,
                interpret=True,
                flash=flash,
                branch_ids=branch,
            ),
            q,
            k,
            v,
            cot,
        )
        for flash in (None, FLASH_TILES)
    ]
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _tree_ids(t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segment, branch and position ids [N, T] of shared-prompt rows (`pack_groups`' layout):
    row 0 a group of two responses and one of three, then padding; row 1 left padding, then a
    group of two. Branch positions continue from the prompt's."""
    seg, branch, pos = (np.zeros((N, t), np.int32) for _ in range(3))
    groups = [(0, 0, [30, 40, 30]), (0, 100, [20, 30, 20, 15]), (1, 10, [50, 70, t - 130])]
    for s, (row, start, sizes) in enumerate(groups, start=1):
        prompt = sizes[0]
        seg[row, start : start + sum(sizes)] = s
        pos[row, start : start + prompt] = np.arange(prompt)
        at = start + prompt
        for b, size in enumerate(sizes[1:], start=1):
            branch[row, at : at + size] = b
            pos[row, at : at + size] = prompt + np.arange(size)
            at += size
    return seg, branch, pos


@pytest.mark.parametrize(
    "mask, dtype, fused_backward",
    [
        ("branches", jnp.float32, False),
        ("branches", jnp.float32, True),
        ("window", jnp.float32, True),
        ("branches+window", jnp.float32, False),
        ("branches", jnp.bfloat16, True),
    ],
)
def test_splash_attention_on_the_shared_prompt_tree_and_a_window(mask, dtype, fused_backward):
    """Branch ids (a shared prompt seen by each of its responses, a response by no sibling) and a
    sliding window over positions: the kernel's dynamic mask against the CPU attention on
    `attention_mask`, rows of 200 tokens (256 inside)."""
    t = 200
    q, k, v, cot = _inputs(t, dtype, seed=4)
    seg, branch, pos = (jnp.asarray(a) for a in _tree_ids(t))
    if mask == "window":  # packed rows, no branches: positions restart per segment
        packed = _segments("packed", t)
        starts = np.maximum.accumulate(
            np.where(np.diff(packed, prepend=-1, axis=-1) != 0, np.arange(t), 0), axis=-1
        )
        seg, pos = jnp.asarray(packed), jnp.asarray(np.arange(t) - starts)
    branch_ids = None if mask == "window" else branch
    window = 24 if "window" in mask else None
    scale = 1.0 / np.sqrt(D)
    got = _value_and_grads(
        lambda q, k, v: splash_attention(
            q,
            k,
            v,
            seg,
            scale,
            block_q=128,
            block_kv=128,
            fused_backward=fused_backward,
            interpret=True,
            branch_ids=branch_ids,
            positions=pos,
            sliding_window=window,
        ),
        q,
        k,
        v,
        cot,
    )
    rule = attention_mask(seg, pos, branch_ids, window)

    def reference(q, k, v):
        qh = q.reshape(N, t, K, H // K, D).transpose(0, 2, 3, 1, 4)
        out = attend(qh, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), rule, scale)
        return out.transpose(0, 3, 1, 2, 4).reshape(N, t, H, D)

    want = _value_and_grads(reference, q, k, v, cot)
    _assert_close(got, want, dtype)
    assert np.all(np.asarray(got[0])[np.asarray(seg) == 0] == 0)
    # Control: the rule matters here (the causal rule within segments alone differs).
    plain = _value_and_grads(lambda q, k, v: _reference(q, k, v, seg, scale), q, k, v, cot)
    assert np.abs(np.asarray(plain[0]) - np.asarray(want[0])).max() > 0.1


def test_tree_masks_are_rebuilt_not_kept_by_save_attention():
    """Under remat "save_attention" the splash kernel's dynamic mask (bool, a [T, T] per row and
    layer) is not among the kept residuals; q, k, v, the output and log-sum-exp are. The
    gradient equals the one without remat."""
    t = 200
    q, k, v, cot = _inputs(t, jnp.float32, seed=5)
    seg, branch, _ = (jnp.asarray(a) for a in _tree_ids(t))

    def attention(q, k, v):
        out = splash_attention(
            q, k, v, seg, 0.125, block_q=128, block_kv=128, interpret=True, branch_ids=branch
        )
        return jnp.sum(out * cot)

    policy = jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS)
    kept = jax.checkpoint(attention, policy=policy)
    named = [
        e.outvars[0].aval.dtype
        for e in _equations(jax.make_jaxpr(jax.grad(kept, (0, 1, 2)))(q, k, v).jaxpr)
        if e.primitive.name == "name"
    ]
    assert jnp.float32 in named and jnp.bool_ not in named, named
    for a, b in zip(
        jax.grad(kept, (0, 1, 2))(q, k, v), jax.grad(attention, (0, 1, 2))(q, k, v), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=F32_TOLERANCE, rtol=0)


@pytest.mark.parametrize("fused_backward", [False, True])
def test_splash_attention_with_its_own_backward_tiles(fused_backward):
    """Forward tiles 256 x 256 computed 128 keys at a time, backward tiles 128 x 256, on rows of
    300 tokens (padded to 512 inside), packed."""
    t = 300
    q, k, v, cot = _inputs(t, jnp.float32, seed=2)
    seg = jnp.asarray(_segments("packed", t))
    scale = 1.0 / np.sqrt(D)
    tiles = dict(block_q=256, block_kv=256, block_kv_compute=128, bwd_block_q=128, bwd_block_kv=256)
    got = _value_and_grads(
        lambda q, k, v: splash_attention(
            q, k, v, seg, scale, fused_backward=fused_backward, interpret=True, **tiles
        ),
        q,
        k,
        v,
        cot,
    )
    want = _value_and_grads(lambda q, k, v: _reference(q, k, v, seg, scale), q, k, v, cot)
    _assert_close(got, want, jnp.float32)
    with pytest.raises(ValueError, match="must divide"):
        splash_attention(q, k, v, seg, scale, block_kv=256, block_kv_compute=384, interpret=True)


@pytest.mark.parametrize("fused_backward", [False, True])
def test_splash_attention_bfloat16_and_fused_backward(fused_backward):
    t = 256
    q, k, v, cot = _inputs(t, jnp.bfloat16, seed=1)
    seg = jnp.asarray(_segments("packed", t))
    scale = 1.0 / np.sqrt(D)
    got = _value_and_grads(
        lambda q, k, v: splash_attention(
            q,
            k,
            v,
            seg,
            scale,
            block_q=128,
            block_kv=128,
            fused_backward=fused_backward,
            interpret=True,
        ),
        q,
        k,
        v,
        cot,
    )
    want = _value_and_grads(lambda q, k, v: _reference(q, k, v, seg, scale), q, k, v, cot)
    _assert_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["left_padded", "packed"])
def test_xla_attention_matches_cpu_attention(dtype, layout):
    t = 96
    q, k, v, cot = _inputs(t, dtype, seed=2)
    seg = jnp.asarray(_segments(layout, t))
    positions = jnp.maximum(jnp.cumsum(seg != 0, axis=-1) - 1, 0)
    mask = attention_mask(seg, positions)
    scale = 1.0 / np.sqrt(D)

    def xla(q, k, v):
        out = xla_attention(q.reshape(N, t, K, H // K, D), k, v, mask, scale)
        return out.reshape(N, t, H, D)

    got = _value_and_grads(xla, q, k, v, cot)
    want = _value_and_grads(lambda q, k, v: _reference(q, k, v, seg, scale), q, k, v, cot)
    _assert_close(got, want, dtype)


def test_flash_tiles_fit_the_row():
    from rewardax.models.pallas_attention import flash_tiles

    assert flash_tiles(TPU_FLASH_TILES, 2048) == (1024,) * 4
    assert flash_tiles(TPU_FLASH_TILES, 3000) == (1024,) * 4  # 3072 either way
    assert flash_tiles(TPU_FLASH_TILES, 1536) == (512,) * 4  # not 1024s padding to 2048
    assert flash_tiles(TPU_FLASH_TILES, 300) == (384,) * 4  # a short row's own length
    assert flash_tiles((512, 1024, 256, 512), 1100) == (512, 512, 256, 512)


def test_select_kernels_by_backend_and_override():
    cpu, tpu, gpu = (select_kernels("auto", b) for b in ("cpu", "tpu", "cuda"))
    assert (cpu.attention, cpu.written_projection_backward) == ("cpu_blocked", True)
    assert (tpu.attention, tpu.written_projection_backward, tpu.interpret) == (
        "splash",
        False,
        False,
    )
    assert (gpu.attention, gpu.written_projection_backward) == ("xla", False)
    # rewardax's flash kernels on a TPU (`Kernels.flash`); pallas in interpret mode off a TPU
    # runs splash unless a test asks for flash
    assert (tpu.flash, select_kernels("pallas", "cpu").flash) == (TPU_FLASH_TILES, None)
    # XLA:TPU sums bf16 reductions in float32 by itself (`Kernels.float32_sums`)
    assert (cpu.float32_sums, tpu.float32_sums, gpu.float32_sums) == (True, False, True)
    assert select_kernels("pallas", "cpu").float32_sums
    assert select_kernels("xla", "cpu").attention == "xla"
    assert select_kernels("pallas", "cpu").interpret  # off a TPU: interpret mode
    with pytest.raises(ConfigError, match="kernels="):
        select_kernels("flash")
    with pytest.raises(ConfigError, match="kernels="):
        RewardModel(_tiny_config(), kernels="flash", rngs=nnx.Rngs(0))


def _sub_jaxprs(eqn):
    """The jaxprs an equation holds (scan's body, custom_vjp's, a Pallas kernel's)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner


def _equations(jaxpr):
    """Every equation of a jaxpr and of its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in _sub_jaxprs(eqn):
            yield from _equations(inner)


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in a jaxpr, sub-jaxprs included."""
    return [e.params["precision"] for e in _equations(jaxpr) if e.primitive.name == "dot_general"]


def _model_gradient_precisions(kernels, matmul_dtype=None) -> list:
    model = RewardModel(
        _tiny_config(), matmul_dtype=matmul_dtype, kernels=kernels, rngs=nnx.Rngs(0)
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.ones((1, 130), jnp.int32)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(ids).logits)  # noqa: E731
    return _dot_precisions(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)


HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("setting", ["xla", "pallas"])
def test_float32_models_run_float32_products_off_the_cpu(setting):
    """A TPU runs float32 matmuls as one bf16 pass unless asked: off the CPU, every product of a
    float32 model, forward and backward (the splash kernel's written backward too), is traced at
    HIGHEST; with bf16 matmuls only the float32 reward head is, and RoPE's rotation where it is
    a product. The CPU's program is unchanged."""
    with jax.default_matmul_precision("default"):  # not this module's float32 fixture
        off_cpu = dataclasses.replace(select_kernels(setting, "tpu"), interpret=True)
        assert off_cpu.float32_precision == "highest"
        f32 = _model_gradient_precisions(off_cpu)
        assert len(f32) > 20 and all(p == HIGHEST for p in f32)
        slices = dataclasses.replace(off_cpu, rope_matmul=False)
        bf16 = _model_gradient_precisions(slices, matmul_dtype="bfloat16")
        # The float32 reward head, by design: its forward and its two gradients.
        assert sum(p == HIGHEST for p in bf16) == 3 and len(bf16) > 20
        # RoPE's rotation as a product (`Kernels.rope_matmul`) rotates float32 q and k: its
        # products, and only they, come in addition, all at HIGHEST (exact).
        rope = _model_gradient_precisions(off_cpu, matmul_dtype="bfloat16")
        added = len(rope) - len(bf16)
        assert added == (4 if off_cpu.rope_matmul else 0)
        assert sum(p == HIGHEST for p in rope) == 3 + added
        cpu = select_kernels("auto", "cpu")
        assert cpu.float32_precision is None
        assert sum(p == HIGHEST for p in _model_gradient_precisions(cpu)) == 3


def _count_primitives(jaxpr, name: str) -> int:
    return sum(e.primitive.name == name for e in _equations(jaxpr))


def _count_live_primitives(jaxpr, name: str) -> int:
    """`_count_primitives` over the equations whose results are used (or that have effects), in
    the jaxpr and in the sub-jaxprs of those, as XLA's dead code removal leaves them: remat's
    recomputation may trace a kernel whose outputs are all kept already and leave it unused
    (JAX keeps every `pallas_call` in a jaxpr; XLA removes an unused one)."""

    def live(jaxpr):
        used = {v for v in jaxpr.outvars if hasattr(v, "aval") and not hasattr(v, "val")}
        kept = []
        for eqn in reversed(jaxpr.eqns):
            if eqn.effects or any(v in used for v in eqn.outvars):
                kept.append(eqn)
                used.update(v for v in eqn.invars if not hasattr(v, "val"))
        for eqn in reversed(kept):
            yield eqn
            for inner in _sub_jaxprs(eqn):
                yield from live(inner)

    return sum(e.primitive.name == name for e in live(jaxpr))


@pytest.mark.slow
@pytest.mark.parametrize("flash", [None, FLASH_TILES], ids=["splash", "flash"])
def test_save_attention_remat_runs_no_second_attention_forward(flash):
    """remat "save_attention" keeps the splash kernel's (or rewardax's flash kernel's) output and
    residuals: the gradient's program has one forward kernel per layer where "full" has two
    (forward and recompute), and the gradients equal those of remat "none"."""
    config = dataclasses.replace(_tiny_config(), num_hidden_layers=9)  # scanned, not unrolled
    ids = jax.random.randint(jax.random.key(1), (2, 130), 3, 128)
    kernels = dataclasses.replace(select_kernels("pallas", "cpu"), flash=flash)

    def gradient(policy):
        dense = policy.endswith("dense")  # the residuals kept in 128-wide rows
        policy = policy.removesuffix(" dense")
        chosen = dataclasses.replace(kernels, dense_residuals=dense)
        model = RewardModel(config, remat_policy=policy, kernels=chosen, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(ids).logits)  # noqa: E731
        return jax.make_jaxpr(jax.grad(loss))(params).jaxpr, jax.jit(jax.grad(loss))(params)

    kernels_in = {}
    policies = ("none", "full", "save_attention", "offload_attention")
    for policy in (*policies, "save_attention dense", "offload_attention dense"):
        jaxpr, grads = gradient(policy)
        kernels_in[policy] = _count_live_primitives(jaxpr, "pallas_call")
        if policy != "none":  # the 64-wide residuals are marked in 128-wide rows when dense
            widths = {
                e.outvars[0].aval.shape[-1]
                for e in _equations(jaxpr)
                if e.primitive.name == "name" and e.params["name"] == ATTENTION_RESIDUALS
            }
            assert widths and ((128 in widths) == policy.endswith("dense")), (policy, widths)
        if policy == "none":
            want = jax.tree.leaves(grads)
        else:
            for a, b in zip(jax.tree.leaves(grads), want, strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    # Per scanned layer: forward + backward kernel(s); "full" adds a second forward.
    assert kernels_in["save_attention"] == kernels_in["none"]
    assert kernels_in["offload_attention"] == kernels_in["none"]
    assert kernels_in["save_attention dense"] == kernels_in["offload_attention dense"]
    assert kernels_in["save_attention dense"] == kernels_in["none"]
    assert kernels_in["full"] == kernels_in["none"] + 1


def test_save_attention_mlp_recomputes_no_matmul():
    """remat "save_attention_mlp" keeps the splash kernel's residuals, attention's output
    projection and the MLP's gate and up projections: the gradient's program has as many
    matmuls as with remat "none" (only norms and elementwise operations are recomputed), where
    "save_attention" recomputes projections; the gradients are those of "none"."""
    config = _tiny_config()  # 2 layers, unrolled
    ids = jax.random.randint(jax.random.key(2), (2, 64), 3, 128)
    kernels = select_kernels("pallas", "cpu")

    def gradient(policy):
        model = RewardModel(config, remat_policy=policy, kernels=kernels, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(ids).logits)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
        return _count_primitives(jaxpr, "dot_general"), jax.jit(jax.grad(loss))(params)

    dots_none, want = gradient("none")
    dots = {}
    for policy in ("save_attention", "save_attention_mlp"):
        dots[policy], grads = gradient(policy)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    assert dots["save_attention_mlp"] == dots_none
    assert dots["save_attention"] > dots_none


@pytest.mark.parametrize("dense", [True, False])
def test_kept_residuals_fill_128_wide_rows_when_dense(dense):
    """`traced_under(..., dense=True)` marks each residual whose minor dimension is narrower than
    128 in 128-wide rows (what a remat policy keeping the name stores); the gradient is the
    same either way. A residual whose rows do not pair up is kept as it is."""
    policy = jax.checkpoint_policies.save_only_these_names("kept")
    fn = traced_under("highest", jnp.sin, "kept", dense=dense)  # keeps cos(x), x's shape
    for shape, dense_shape in [((2, 256, 64), (2, 128, 128)), ((3, 64), (3, 64))]:
        x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
        loss = lambda x: jnp.sum(jax.checkpoint(fn, policy=policy)(x) ** 2)  # noqa: E731
        named = [
            e.outvars[0].aval.shape
            for e in _equations(jax.make_jaxpr(jax.grad(loss))(x).jaxpr)
            if e.primitive.name == "name"
        ]
        assert named and all(s == (dense_shape if dense else shape) for s in named), named
        np.testing.assert_allclose(
            np.asarray(jax.grad(loss)(x)), np.asarray(2 * jnp.sin(x) * jnp.cos(x)), rtol=1e-6
        )


def test_bfloat16_splash_keeps_its_precision_under_a_float32_setting():
    """The kernel cannot take bf16 operands at float32 precision (Mosaic: "Bad lhs type"): under
    a caller's "highest", its bf16 products, forward and backward, stay at the default."""
    q, k, v, cot = _inputs(256, jnp.bfloat16)
    seg = jnp.asarray(_segments("packed", 256))

    def loss(q, k, v):
        return jnp.sum(splash_attention(q, k, v, seg, 0.125, interpret=True) * cot)

    with jax.default_matmul_precision("highest"):
        precisions = _dot_precisions(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr)
    assert len(precisions) >= 5 and HIGHEST not in precisions


def _tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="qwen2",
        vocab_size=128,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.mark.parametrize("layout", ["padded", "packed", "branches"])
@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
def test_reward_model_kernels_agree(layout, matmul_dtype):
    """The whole model under `pallas` (interpret mode) and `xla` against `cpu`: rewards and
    every parameter's gradient. bf16 matmuls: the projections' backward differs only in rounding
    (the written one and autodiff round the same products), so the same 2e-2 bound."""
    _assert_model_kernels_agree(layout, matmul_dtype, ("pallas", "xla"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "packed", "branches"])
@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
def test_reward_model_with_flash_attention_agrees(layout, matmul_dtype):
    """As above, `pallas` with rewardax's flash kernel (`Kernels.flash`)."""
    flash = dataclasses.replace(select_kernels("pallas", "cpu"), flash=FLASH_TILES)
    _assert_model_kernels_agree(layout, matmul_dtype, (flash,))


def _assert_model_kernels_agree(layout, matmul_dtype, settings) -> None:
    t = 130  # not a multiple of the tile
    ids = jax.random.randint(jax.random.key(1), (2, t), 3, 128)
    seg = jnp.asarray(_segments("packed", t))
    kwargs: dict = {"attention_mask": (seg != 0).astype(jnp.int32)}
    if layout in ("packed", "branches"):
        kwargs = {"segment_ids": seg, "reward_positions": jnp.array([[40, 100], [5, 120]])}
    if layout == "branches":
        branch = np.zeros((2, t), np.int32)
        branch[:, 60:80], branch[:, 80:110] = 1, 2
        kwargs["branch_ids"] = jnp.asarray(branch)

    def run(kernels):
        model = RewardModel(
            _tiny_config(), matmul_dtype=matmul_dtype, kernels=kernels, rngs=nnx.Rngs(0)
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            logits = nnx.merge(graphdef, p, rest)(ids, **kwargs).logits
            return jnp.sum(logits * jnp.arange(1, logits.size + 1).reshape(logits.shape)), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return [logits, *jax.tree.leaves(grads)]

    want = run("cpu")
    for kernels in settings:
        got = run(kernels)
        for a, b in zip(got, want, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            if matmul_dtype is None:
                scale = max(1.0, float(np.abs(b).max())) if ON_TPU else 1.0
                np.testing.assert_allclose(
                    a, b, atol=MODEL_ATOL * scale, rtol=MODEL_RTOL, err_msg=kernels
                )
            else:
                bound = 2e-2 * max(1.0, float(np.abs(b).max()))
                assert np.abs(a - b).max() <= bound, (kernels, np.abs(a - b).max(), bound)


@needs_tpu
@pytest.mark.parametrize("fused_backward, flash", [(False, False), (True, False), (True, True)])
def test_splash_attention_compiled_on_tpu(fused_backward, flash):
    """The compiled kernel (not interpret mode) at a v5e tile of 512, bf16 inputs; `flash`:
    rewardax's own kernel at the same tiles."""
    t = 1024
    q, k, v, cot = _inputs(t, jnp.bfloat16, seed=3)
    seg = jnp.asarray(_segments("packed", t))
    scale = 1.0 / np.sqrt(D)
    with jax.default_matmul_precision("default"):  # bf16 inputs: the kernel's own precision
        got = _value_and_grads(
            jax.jit(
                lambda q, k, v: splash_attention(
                    q,
                    k,
                    v,
                    seg,
                    scale,
                    block_q=512,
                    block_kv=512,
                    fused_backward=fused_backward,
                    flash=(512, 512, 512, 512) if flash else None,
                )
            ),
            q,
            k,
            v,
            cot,
        )
    want = _value_and_grads(
        lambda q, k, v: _reference(q, k, v, seg, scale),
        *(a.astype(jnp.float32) for a in (q, k, v)),
        cot,
    )
    _assert_close(got, want, jnp.bfloat16)


V5E_COMPILE = """
import jax, jax.numpy as jnp
from rewardax.models.pallas_attention import splash_attention
from rewardax.plan import topology_devices
device = topology_devices("v5e:1x1")[0]
sharding = jax.sharding.NamedSharding(jax.sharding.Mesh([device], ("x",)), jax.sharding.PartitionSpec())
def loss(q, k, v, seg):
    out = splash_attention(q, k, v, seg, 0.125, flash=(512, 512, 512, 1024))
    return out.astype(jnp.float32).sum()
aval = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
args = [aval((2, 2000, 14, 64), jnp.bfloat16), aval((2, 2000, 2, 64), jnp.bfloat16),
        aval((2, 2000, 2, 64), jnp.bfloat16), aval((2, 2000), jnp.int32)]
compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
print("custom calls", compiled.as_text().count("tpu_custom_call"))
"""


@pytest.mark.slow
def test_flash_attention_compiles_for_a_v5e():
    """Interpret mode does not check what Mosaic lowers: rewardax's flash kernels (forward and
    backward, Qwen2.5-0.5B's heads, a row padded to the tiles) compiled for a v5e by libtpu on
    this CPU (libtpu from `make test`, in .venv/libtpu)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    libtpu = Path(__file__).resolve().parent.parent / ".venv" / "libtpu"
    libtpu = Path(os.environ.get("REWARDAX_LIBTPU_DIR", libtpu))
    if not (libtpu / "libtpu").is_dir():
        pytest.fail(f"libtpu is not in {libtpu}: `make test` installs it (requirements-tpu.lock)")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(libtpu),
        "TPU_SKIP_MDS_QUERY": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", V5E_COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The forward kernel, and the backward's (the forward again under the gradient: its
    # residuals are the outputs of the one forward, so one forward call, one backward call).
    assert "custom calls 2" in proc.stdout, proc.stdout
