"""The mesh and the one sharding table: specs, real splits on 8 host devices, memory, resharding.

Cases that need several devices run tests/scale_worker.py in a subprocess (the host device count is
fixed when JAX starts) and assert here on the JSON it writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from rewardax import RewardConfig
from rewardax.errors import ConfigError
from rewardax.sharding import LOGICAL_AXIS_RULES, MESH_AXES, logical_to_mesh_spec, make_mesh

# Left out of `make test`, run by `make test-slow`: trains on meshes of 8 host devices against one device.
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("scale_worker.py")


def run_worker(case: str, devices: int, tmp_path: Path, timeout: int = 600) -> dict:
    out = tmp_path / f"{case}.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [
            sys.executable,
            str(WORKER),
            case,
            str(out),
            "--devices",
            str(devices),
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, f"worker {case} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def mesh(dp: int, fsdp: int, tp: int) -> AbstractMesh:
    return AbstractMesh((dp, fsdp, tp), MESH_AXES)


# ---- the table, without devices -------------------------------------------------------------------


def test_specs_follow_the_table():
    m = mesh(2, 2, 2)
    assert logical_to_mesh_spec(("embed", "mlp"), (32, 64), m) == PartitionSpec("fsdp", "tp")
    assert logical_to_mesh_spec(("mlp", "embed"), (64, 32), m) == PartitionSpec("tp", "fsdp")
    assert logical_to_mesh_spec(
        (None, "embed", "heads", "head_dim"), (2, 32, 4, 8), m
    ) == PartitionSpec(None, "fsdp", "tp", None)
    assert logical_to_mesh_spec(("norm",), (32,), m) == PartitionSpec(None)
    assert logical_to_mesh_spec(None, (3,), m) == PartitionSpec()


def test_indivisible_dimension_stays_replicated_and_size_one_axes_are_dropped():
    # 2 kv heads cannot be split 4 ways: that dimension is replicated, the rest still split.
    spec = logical_to_mesh_spec(("embed", "kv_heads", "head_dim"), (32, 2, 8), mesh(1, 2, 4))
    assert spec == PartitionSpec("fsdp", None, None)
    # On a dp-only mesh nothing is split (fsdp and tp have size 1).
    assert logical_to_mesh_spec(("embed", "mlp"), (32, 64), mesh(8, 1, 1)) == PartitionSpec(
        None, None
    )


def test_every_table_target_is_a_mesh_axis():
    for name, target in LOGICAL_AXIS_RULES.items():
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        assert set(axes) <= set(MESH_AXES), name


def test_mesh_size_mismatch_says_what_to_change():
    with pytest.raises(ConfigError, match="product is 1"):
        make_mesh(2, 1, 1, devices=jax.devices()[:1])
    config = RewardConfig(mesh={"dp": 3, "fsdp": 1, "tp": 1})
    with pytest.raises(ConfigError, match="make the product match or set one axis to -1"):
        config.validate(num_devices=8)


def test_data_parallel_size_must_split_over_processes():
    config = RewardConfig(mesh={"dp": 1, "fsdp": 1, "tp": -1})
    with pytest.raises(ConfigError, match="not a multiple of the 2 processes"):
        config.validate(num_devices=4, num_processes=2)
    RewardConfig(mesh={"dp": 1, "fsdp": 2, "tp": -1}).validate(num_devices=4, num_processes=2)


# ---- on 8 (or 4) host devices, in a subprocess ---------------------------------------------------


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    return run_worker("mesh_parity", 8, tmp_path_factory.mktemp("parity"))


def test_dp2_fsdp2_tp2_matches_one_device_over_five_steps(parity):
    assert len(parity["losses"]) == 5
    np.testing.assert_allclose(parity["losses"], parity["reference_losses"], rtol=0, atol=1e-5)
    assert parity["losses"][-1] < parity["losses"][0]  # it trained, on both
    # Adam turns tiny float-reassociation differences of the gradients into small update
    # differences; they stay far below how far the parameters moved.
    assert parity["params_moved"] > 1e-2
    assert parity["max_param_diff"] < 1e-4


def test_splash_attention_runs_per_shard_on_a_mesh(tmp_path):
    """Pallas kernels cannot be partitioned by XLA ("Mosaic kernels cannot be automatically
    partitioned", found by `rewardax plan` for a v5e:2x4 slice; test_plan's compile for that
    slice fails without shard_map, while here on the CPU the interpret-mode kernel is plain XLA):
    the per-shard split (rows over dp x fsdp, heads over tp) gives the one-device step's losses
    and parameters over 5 SGD steps."""
    out = run_worker("splash_mesh_parity", 8, tmp_path)
    assert len(out["losses"]) == 5
    # 1.6e-5 apart at step 4 of 5 (losses ~0.3, learning rate 1e-2): sums in another order.
    np.testing.assert_allclose(out["losses"], out["reference_losses"], rtol=0, atol=5e-5)
    assert out["losses"][-1] < out["losses"][0]
    assert out["params_moved"] > 1e-2
    assert out["max_param_diff"] < 1e-4


def test_gradients_summed_by_reference_on_a_mesh_match_one_device(tmp_path):
    """`Kernels.accumulate_by_reference` on dp2 x fsdp2 x tp2, 2 microbatches a step: the running
    sums (references, sharded like the parameters) give the one-device whole-batch step's
    losses and parameters over 5 SGD steps."""
    out = run_worker("accumulate_mesh_parity", 8, tmp_path)
    assert len(out["losses"]) == 5
    np.testing.assert_allclose(out["losses"], out["reference_losses"], rtol=0, atol=5e-5)
    assert out["losses"][-1] < out["losses"][0]
    assert out["params_moved"] > 1e-2
    assert out["max_param_diff"] < 1e-4


def test_splash_attention_on_the_shared_prompt_tree_runs_per_shard(tmp_path):
    """data.layout=shared_prompt with splash attention (its mask built from the branch ids,
    split with the rows) on dp 2 x fsdp 2 x tp 2: the one-device step's losses and parameters."""
    out = run_worker("splash_tree_mesh_parity", 8, tmp_path)
    assert len(out["losses"]) == 5
    np.testing.assert_allclose(out["losses"], out["reference_losses"], rtol=0, atol=5e-5)
    # Five batches of 8 short pairs: the losses are each batch's (0.69 to 1.05), not a trend.
    # The parameters moved 4.1e-3 and the two runs' stayed 9.3e-9 apart.
    assert out["params_moved"] > 1e-3
    assert out["max_param_diff"] < 1e-6


def test_weight_matrices_are_really_split(parity):
    lay = parity["layout"]

    def check(fragment, spec, shard):
        (key,) = [k for k in lay if fragment in k]
        assert lay[key]["spec"] == spec, key
        assert lay[key]["shard_shapes"] == [shard], key

    check("embed_tokens", ["tp", "fsdp"], [16, 16])  # [vocab 32, embed 32]
    check("gate_proj", [None, "fsdp", "tp"], [2, 16, 32])  # [layers, embed 32, mlp 64]
    check("down_proj", [None, "tp", "fsdp"], [2, 32, 16])  # [layers, mlp 64, embed 32]
    check("q_proj", [None, "fsdp", "tp", None], [2, 16, 2, 8])  # [layers, embed, heads 4, 8]
    check("k_proj", [None, "fsdp", "tp", None], [2, 16, 1, 8])  # 2 kv heads over tp=2
    check("o_proj", [None, "tp", None, "fsdp"], [2, 2, 8, 16])
    check("score", ["fsdp", None], [16, 1])
    check("['norm']", [None], [32])  # norm scales are replicated
    # Adam's moments are split exactly like their parameters.
    opt = parity["opt_layout"]
    for fragment in ("gate_proj", "q_proj", "embed_tokens"):
        moments = [v for k, v in opt.items() if fragment in k]
        (param,) = [v for k, v in lay.items() if fragment in k]
        assert len(moments) == 2  # mu and nu
        for moment in moments:
            assert moment["spec"] == param["spec"]
            assert moment["shard_shapes"] == param["shard_shapes"]


def test_fsdp8_holds_an_eighth_of_the_bytes_per_device(tmp_path):
    mem = run_worker("memory", 8, tmp_path)
    assert mem["replicated"]["devices"] == mem["fsdp"]["devices"] == 8
    ratio = mem["fsdp"]["max"] / mem["replicated"]["max"]
    # Exactly 1/8 but for the small replicated pieces (norm scales, the step counter).
    assert 1 / 8 <= ratio < 0.14, ratio


def test_checkpoint_from_fsdp4_resumes_under_fsdp2_tp2(tmp_path):
    r = run_worker("reshard", 4, tmp_path)
    assert r["restored_step"] == 3 and r["saved_steps"][0] == 3
    assert r["restore_max_diff"] == 0.0  # the values survive resharding bit for bit
    lay = r["restored_layout"]
    (gate,) = [v for k, v in lay.items() if "gate_proj" in k]
    assert gate["spec"] == [None, "fsdp", "tp"] and gate["shard_shapes"] == [[2, 16, 32]]
    (gate_mu, _gate_nu) = [v for k, v in r["restored_opt_layout"].items() if "gate_proj" in k]
    assert gate_mu["spec"] == [None, "fsdp", "tp"]
    # Continuing under the new mesh gives the losses of the uninterrupted fsdp=4 run.
    assert len(r["first_losses"]) == 3 and len(r["second_losses"]) == 3
    np.testing.assert_allclose(
        r["first_losses"] + r["second_losses"], r["straight_losses"], rtol=0, atol=1e-5
    )
    assert r["final_max_diff"] < 1e-4
