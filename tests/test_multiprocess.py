"""Multi-process training under jax.distributed on localhost (CPU collectives: gloo), against one
process holding the same number of devices; plus the single-process behaviour of the helpers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from rewardax import distributed
from rewardax.config import DistributedSection, RewardConfig
from rewardax.data.groups import collate_groups
from rewardax.errors import ConfigError
from rewardax.losses import RANKING_LOSSES
from rewardax.sharding import batch_sharding, make_mesh

# Left out of `make test`, run by `make test-slow`: trains in several jax.distributed processes.
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("scale_worker.py")
TIMEOUT = 600


# ---- helpers on one process -----------------------------------------------------------------------


def test_initialize_is_a_no_op_without_multi_process_settings(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    info = distributed.initialize(RewardConfig())
    assert (info.process_index, info.process_count) == (0, 1)
    assert info.device_count == jax.device_count()
    assert distributed.initialize(DistributedSection(num_processes=1)).process_count == 1


def test_initialize_after_jax_started_is_an_error_that_says_what_to_do(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    jax.devices()  # JAX has started in this process
    settings = DistributedSection(coordinator_address="localhost:1", num_processes=2, process_id=0)
    with pytest.raises(ConfigError, match="before building or loading the model"):
        distributed.initialize(settings)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ConfigError, match=r"JAX_NUM_PROCESSES='two' must be an integer"):
        distributed.initialize()


def test_distributed_section_is_checked_and_kept_out_of_the_run_name():
    with pytest.raises(ConfigError, match=r"process_id=2 must be in 0\.\.num_processes-1"):
        RewardConfig(distributed={"num_processes": 2, "process_id": 2}).validate()
    config = RewardConfig.from_dict({"distributed": {"process_id": 1, "num_processes": 4}})
    assert config.distributed.process_id == 1 and config.num_processes == 4


def test_pad_to_length_and_padding_batches():
    batch = {
        "input_ids": np.full((2, 2, 3), 7, np.int32),
        "attention_mask": np.ones((2, 2, 3), np.int32),
        "reward_index": np.full((2, 2), 2, np.int32),
        "margin": np.zeros(2, np.float32),
        "pair_mask": np.ones(2, np.float32),
    }
    padded = distributed.pad_to_length(batch, 5, pad_id=0)
    assert padded["input_ids"].shape == (2, 2, 5)
    assert padded["input_ids"][0, 0].tolist() == [7, 7, 7, 0, 0]
    assert padded["attention_mask"][0, 0].tolist() == [1, 1, 1, 0, 0]
    assert padded["reward_index"].tolist() == batch["reward_index"].tolist()
    empty = distributed.padding_batch(4, 5, [*batch, "row_index"])
    assert empty["input_ids"].shape == (4, 2, 5) and empty["pair_mask"].sum() == 0
    assert empty["row_index"].tolist() == [-1] * 4
    with pytest.raises(ValueError):
        distributed.pad_to_length(padded, 3, pad_id=0)


def test_single_process_collectives_are_identities():
    assert distributed.agree_max(5) == 5
    assert distributed.process_sum(2.5) == 2.5
    assert distributed.gather_json({"a": [1, 2]}) == [{"a": [1, 2]}]
    n = jax.device_count()
    sharding = batch_sharding(make_mesh(n, 1, 1))
    assert distributed.local_row_indices(sharding, 4 * n).tolist() == list(range(4 * n))
    batches = [{"input_ids": np.zeros((1, 2, t), np.int32)} for t in (3, 5)]
    out = list(distributed.lockstep(batches, pad_id=0))
    assert [b["input_ids"].shape[-1] for b in out] == [3, 5]  # one process: nothing to agree on


def as_process_0_of_2(monkeypatch, others: list[dict | None]) -> None:
    """Runs `distributed.lockstep` as process 0 of 2: process 1's batches are `others` (None: it
    has run out), seen only through what the all-gathers return."""
    statuses = iter([[b is not None, 0 if b is None else b["input_ids"].shape[-1]] for b in others])
    layout = next((b for b in others if b is not None), None)

    def allgather(x):
        x = np.asarray(x)
        if x.dtype == np.int64 and x.shape == (2,):  # a step's status: [has a batch, length]
            return np.stack([x, np.asarray(next(statuses), np.int64)])
        raise AssertionError(f"unexpected all-gather of {x.shape} {x.dtype}")

    def gather_json(obj):  # the layouts of the processes' first batches, exchanged once
        return [obj, distributed.batch_layout(layout)]

    monkeypatch.setattr(distributed, "allgather", allgather)
    monkeypatch.setattr(distributed, "gather_json", gather_json)


def group_batch(lengths: list[list[int]], width: int = 3) -> dict[str, np.ndarray]:
    """A ranked-rows batch of 2 rows (`rewardax.data.groups`): `lengths` per row's responses."""
    records = [
        {"responses": [np.arange(1, n + 1, dtype=np.int32) for n in row],
         "targets": np.arange(len(row), dtype=np.float32)}
        for row in lengths
    ]  # fmt: skip
    batch = collate_groups(records, 0, (8, 16), 2, width, "ranks")
    batch["row_index"] = np.asarray([0, -1] if len(records) == 1 else [0, 1], np.int32)
    return batch


def test_lockstep_pads_a_process_that_ran_out_at_the_agreed_length(monkeypatch):
    """Process 0's last batch was 16 tokens long, process 1's next one is 8: process 0's padding
    batch is 8 long too (a global array needs one shape), with 3 responses per row as its own."""
    mine = [group_batch([[12, 3, 3], [4, 4]])]
    as_process_0_of_2(monkeypatch, [group_batch([[5, 5, 5]]), group_batch([[6, 6]]), None])
    out = list(distributed.lockstep(mine, pad_id=0))
    assert [b["input_ids"].shape for b in out] == [(2, 3, 16), (2, 3, 8)]
    padding = out[1]
    assert padding.keys() == mine[0].keys()
    assert padding["row_mask"].sum() == padding["response_mask"].sum() == 0
    assert padding["row_index"].tolist() == [-1, -1]
    assert (padding["attention_mask"].sum(-1) == 1).all()


def test_lockstep_pads_a_process_without_rows_in_the_others_layout(monkeypatch):
    """An eval set with fewer rows than processes: process 0 has no batch of its own and pads
    in process 1's layout (group rows here, not pairs)."""
    theirs = group_batch([[5]], width=1)
    as_process_0_of_2(monkeypatch, [theirs, None])
    (padding,) = list(distributed.lockstep([], pad_id=0))
    assert padding.keys() == theirs.keys()
    for key, value in theirs.items():
        assert (padding[key].shape, padding[key].dtype) == (value.shape, value.dtype), key
    assert padding["row_mask"].sum() == 0 and padding["row_index"].tolist() == [-1, -1]


# ---- 2 processes x 2 devices vs 1 process x 4 devices ---------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    out: Path, workdir: Path, devices: int, extra: list[str], case: str = "train_distributed"
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    cmd = [sys.executable, str(WORKER), case, str(out), "--devices", str(devices)]
    cmd += ["--workdir", str(workdir), *extra]
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(procs: list[subprocess.Popen]) -> None:
    errors = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=TIMEOUT)
            if proc.returncode != 0:
                errors.append(err[-4000:])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert not errors, "\n----\n".join(errors)


def single_and_multi(root: Path, case: str) -> tuple[dict, dict]:
    """`case` of scale_worker.py on 2 processes x 2 devices, then on 1 process x 4 devices: the
    results of both (process 0's)."""
    address = f"127.0.0.1:{free_port()}"
    multi = [
        launch(
            root / "multi.json",
            root / "multi",
            2,
            ["--coordinator", address, "--num-processes", "2", "--process-id", str(i)],
            case,
        )
        for i in range(2)
    ]
    finish(multi)
    finish([launch(root / "single.json", root / "single", 4, [], case)])
    return (
        json.loads((root / "single.json").read_text()),
        json.loads((root / "multi.json").read_text()),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return single_and_multi(tmp_path_factory.mktemp("multiprocess"), "train_distributed")


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory):
    return single_and_multi(tmp_path_factory.mktemp("groups"), "train_distributed_groups")


def test_two_processes_train_like_one_process_with_the_same_devices(runs):
    single, multi = runs
    assert (single["process_count"], single["device_count"]) == (1, 4)
    assert (multi["process_count"], multi["device_count"], multi["local_device_count"]) == (2, 4, 2)
    assert len(multi["losses"]) == len(single["losses"]) == 5
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=0, atol=1e-5)
    assert single["losses"][-1] < single["losses"][0]
    assert multi["params"].keys() == single["params"].keys()
    for key in single["params"]:
        np.testing.assert_allclose(multi["params"][key], single["params"][key], atol=1e-4)


def test_two_processes_evaluate_every_pair_once_checkpoint_and_resume(runs):
    single, multi = runs
    # 13 pairs: one process reads 7 rows, the other 6, in batches of 2 (the last ones padded).
    assert multi["eval_num_pairs"] == single["eval_num_pairs"] == 13
    np.testing.assert_allclose(multi["eval_chosen"], single["eval_chosen"], atol=1e-5)
    np.testing.assert_allclose(multi["eval_rejected"], single["eval_rejected"], atol=1e-5)
    assert multi["eval_accuracy"] == single["eval_accuracy"]
    assert multi["checkpoints"] == [5] and multi["export_exists"]
    # Each process resumes at its own data position (they read different rows).
    assert multi["resumed_step"] == 5
    assert len(multi["resumed_positions"]) == 2
    for restored, at_end in multi["resumed_positions"]:
        assert restored == at_end > 0


# ---- group losses: the same comparison ---------------------------------------------------------


def assert_same_params(multi: dict, single: dict) -> None:
    assert multi.keys() == single.keys()
    for key in single:
        np.testing.assert_allclose(multi[key], single[key], atol=1e-4)


# The runs of scale_worker.py's `group_runs`, and how many microbatches each accumulates.
GROUP_RUNS = {
    "plackett_luce": 1,
    "mse": 1,
    "all_pairs_bradley_terry": 2,
    "davidson": 1,
    "gaussian_nll": 1,
    "objectives": 2,  # mse on named scores, model.objectives
}
CLOSE = dict(rtol=1e-5, atol=1e-5)  # losses; rewards up to ~3 here (the pair test's ~0.5)
# Rewards of the trained models: as close as their parameters (`assert_same_params`, 1e-4).
# On the 2026-12-07 machine the two summation orders gave rewards up to 2.2e-5 apart after the
# 5 steps (1.4e-5 for a reward of 0.05), where an earlier machine's stayed within 1e-5; a row
# scored twice, dropped or another row's reward is off by ~1.
REWARDS_CLOSE = dict(rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("run", GROUP_RUNS)
def test_two_processes_train_a_group_loss_like_one_process(group_runs, run):
    """Each process loads its share of every batch of group rows (ranked rows of 4 or 3
    responses, or score rows); the steps see the same global batches as one process does, and
    an update accumulated over 2 microbatches equals one process's."""
    single, multi = group_runs
    assert (single["process_count"], multi["process_count"]) == (1, 2)
    assert single["device_count"] == multi["device_count"] == 4
    single, multi = single[run], multi[run]
    assert len(multi["losses"]) == len(single["losses"]) == 5
    # The pair test's 1e-5, relative as well: mse losses here are ~5 (pair losses ~0.7), and
    # the float noise of the processes' other summation order grows with them.
    np.testing.assert_allclose(multi["losses"], single["losses"], **CLOSE)
    assert single["losses"][-1] < single["losses"][0]
    # 2 rows per device x 2 data-parallel devices, per microbatch.
    assert multi["train_num_rows"] == single["train_num_rows"] == 4 * GROUP_RUNS[run]
    assert_same_params(multi["params"], single["params"])


def assert_same_ranked_eval(single: dict, multi: dict, name: str, loss: str) -> None:
    """Eval set `name` (7 ranked rows, scored as their pairs) gives every pair once, with the
    rewards and metrics of one process; the ranking loss per row when `loss` is one."""
    rewards, rewards_single = multi["rewards"][name], single["rewards"][name]
    pairs = len(rewards_single["row_index"])
    assert rewards["row_index"] == rewards_single["row_index"] == list(range(pairs))
    np.testing.assert_allclose(rewards["chosen"], rewards_single["chosen"], **REWARDS_CLOSE)
    np.testing.assert_allclose(rewards["rejected"], rewards_single["rejected"], **REWARDS_CLOSE)
    ranked, ranked_single = multi["eval"][name], single["eval"][name]
    assert ranked["num_pairs"] == ranked_single["num_pairs"] == pairs
    assert ranked["accuracy"] == ranked_single["accuracy"]
    assert ranked["ranking"]["num_rows"] == ranked_single["ranking"]["num_rows"] == 7
    for metric in ("spearman", "kendall_tau", "top1_accuracy"):
        assert ranked["ranking"][metric] == pytest.approx(
            ranked_single["ranking"][metric], abs=1e-9
        )
    assert ("loss" in ranked["ranking"]) == ("loss" in ranked_single["ranking"])
    assert ("loss" in ranked["ranking"]) == (loss in RANKING_LOSSES)
    if loss in RANKING_LOSSES:
        assert ranked["ranking"]["loss"] == pytest.approx(
            ranked_single["ranking"]["loss"], rel=1e-5
        )


def close_to(metric: float | None):
    """A metric of one process's rewards, to the rewards' tolerance (a mean of 13 rewards of ~1.4
    moves by their float noise); None (undefined, e.g. a correlation over one row) exactly."""
    return None if metric is None else pytest.approx(metric, rel=1e-5, abs=1e-5)


def assert_same_score_eval(single: dict, multi: dict, name: str, rows: int, mse: bool) -> None:
    """Eval set `name` (`rows` score rows) gives every row once, with the rewards and metrics of
    one process (the MSE with `mse`; with named scores every head output, and each objective's
    metrics)."""
    rewards, rewards_single = multi["rewards"][name], single["rewards"][name]
    assert rewards["row_index"] == rewards_single["row_index"] == list(range(rows))
    np.testing.assert_allclose(rewards["rewards"], rewards_single["rewards"], **REWARDS_CLOSE)
    assert ("outputs" in rewards) == ("outputs" in rewards_single)
    if "outputs" in rewards:
        np.testing.assert_allclose(rewards["outputs"], rewards_single["outputs"], **REWARDS_CLOSE)
    scores, scores_single = multi["eval"][name], single["eval"][name]
    assert scores["num_rows"] == scores_single["num_rows"] == rows
    assert ("mse" in scores) == mse
    names = ["spearman", "kendall_tau", "reward_mean", "reward_std"]
    for metric in names + (["mse"] if mse else []):
        assert scores[metric] == close_to(scores_single[metric])
    assert scores.get("objectives", {}).keys() == scores_single.get("objectives", {}).keys()
    for objective, values in scores.get("objectives", {}).items():
        assert values.keys() == scores_single["objectives"][objective].keys()
        for metric, value in values.items():
            assert value == close_to(scores_single["objectives"][objective][metric])


@pytest.mark.parametrize("loss", ["plackett_luce", "mse"])
def test_two_processes_evaluate_every_ranked_and_score_row_once(group_runs, loss):
    """Ranked rows (scored as their pairs) and score rows (group batches of one response) split
    unevenly over the processes: every row once, with the rewards and metrics of one process."""
    single, multi = group_runs[0][loss], group_runs[1][loss]
    # Ranked rows: 5 rows of 4 responses (6 pairs each) and 2 of 3 (3 pairs each).
    assert multi["eval"]["ranked"]["num_pairs"] == 36
    assert_same_ranked_eval(single, multi, "ranked", loss)
    # Score rows: 13 (7 + 6 over the processes, in batches of 2) and a set of 1 (one process
    # has no row of it).
    assert_same_score_eval(single, multi, "scores", 13, mse=loss == "mse")
    assert_same_score_eval(single, multi, "one_score", 1, mse=loss == "mse")


def test_two_processes_evaluate_tied_rows_with_the_davidson_loss(group_runs):
    """Ranked rows with ties (tied responses make no pair) scored by a davidson run: every pair
    once, and the run's ranking loss per row (ties counted), as one process's."""
    single, multi = group_runs[0]["davidson"], group_runs[1]["davidson"]
    assert_same_ranked_eval(single, multi, "tied", "davidson")
    assert 7 <= multi["eval"]["tied"]["num_pairs"] < 36  # fewer than the 36 without ties


def test_two_processes_evaluate_named_scores_per_objective(group_runs):
    """Named-score rows (every third leaves `length` out) scored by a model.objectives run: one
    process's rewards, every head output and the metrics of each objective over its rows."""
    single, multi = group_runs[0]["objectives"], group_runs[1]["objectives"]
    assert_same_score_eval(single, multi, "named", 13, mse=True)
    per_objective = multi["eval"]["named"]["objectives"]
    assert per_objective["quality"]["num_rows"] == 13
    assert per_objective["length"]["num_rows"] == 9  # 13 less rows 2, 5, 8, 11
