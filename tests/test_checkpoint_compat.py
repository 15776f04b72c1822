"""A run checkpointed by rewardax c931687 (before issue #32's redesign) resumes and exports today.

tests/fixtures/checkpoint_c931687.json holds that commit's on-disk format, recorded from a real
run of it: the step directory's files, Orbax's tree metadata of the `state` item (every path, its
container kinds and shape), the dtypes, the `extra` JSON (config, data-iterator state, model
config) and the run folder's config.yaml and metrics.jsonl. Array values are not kept (no weights
in git): the test writes arrays of those paths, shapes and dtypes with the Orbax calls c931687
made, checks that the tree metadata written equals the recorded one, then runs today's trainer and
`rewardax export` on the folder.
"""

from __future__ import annotations

import ast
import json
from importlib import resources
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax.logging import read_metrics

# Left out of `make test`, run by `make test-slow`: trains and exports from an old run's checkpoint.
pytestmark = pytest.mark.slow

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "checkpoint_c931687.json").read_text())
TRAIN = str(resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def old_state_tree(rng: np.random.Generator) -> dict:
    """The `state` item as c931687 saved it: nested dicts and sequences, None for optax's empty
    states, {} for the empty `rest`; arrays drawn from `rng` (step counters = the saved step)."""
    root: dict = {}
    for key, entry in FIXTURE["tree_metadata"].items():
        kinds = [(k["key"], k["key_type"]) for k in entry["key_metadata"]]
        value_type = entry["value_metadata"]["value_type"]
        if value_type == "jax.Array":
            shape = tuple(entry["value_metadata"]["write_shape"])
            dtype = np.dtype(FIXTURE["dtypes"][key])
            if kinds[-1][0] in ("step", "count"):
                value = np.asarray(FIXTURE["step"], dtype)
            elif dtype.kind == "u":  # the RNG key's data
                value = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(dtype)
            else:
                value = (0.02 * rng.standard_normal(shape)).astype(dtype)
                if "nu" in ast.literal_eval(key):  # Adam's second moments are squares
                    value = np.abs(value)
            value = jax.device_put(value)  # c931687 saved device arrays
        else:
            value = {"None": None, "Dict": {}}[value_type]
        node = root
        for name, _kind in kinds[:-1]:
            node = node.setdefault(name, {})
        node[kinds[-1][0]] = value

    def containers(node, key_type=2):
        if not isinstance(node, dict) or not node:
            return node
        items = {k: containers(v, key_type) for k, v in node.items()}
        if all(k.isdigit() for k in items):  # a sequence (key_type 1) in Orbax's metadata
            return [items[str(i)] for i in range(len(items))]
        return items

    return containers(root)


def write_old_checkpoint(run_dir: Path, state: dict) -> None:
    """c931687's TrainCheckpointer.save: one CheckpointManager step with a StandardSave `state`
    and a JsonSave `extra`, plus the run folder's config.yaml and metrics.jsonl."""
    run_dir.mkdir(parents=True)
    for name, text in FIXTURE["run_files"].items():
        (run_dir / name).write_text(text)
    manager = ocp.CheckpointManager(
        run_dir / "checkpoints",
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "extra": ocp.JsonCheckpointHandler(),
        },
    )
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(FIXTURE["extra"])
    )
    manager.save(FIXTURE["step"], args=args, force=True)
    manager.wait_until_finished()
    manager.close()


def config(tmp_path: Path, steps: int) -> rx.RewardConfig:
    """The recorded run's settings (FIXTURE['about']), under the recorded run's folder name."""
    return rx.RewardConfig(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=2,
        max_sequence_length=64,
        max_training_steps=steps,
        save_directory=str(tmp_path),
        run_name=FIXTURE["run_name"],
        logging_steps=1,
        progress_bar=False,
        seed=7,
    )


def test_a_run_checkpointed_by_c931687_resumes_continues_and_exports(tokenizer, tmp_path, capfd):
    run_dir = tmp_path / FIXTURE["run_name"]
    state = old_state_tree(np.random.default_rng(0))
    write_old_checkpoint(run_dir, state)
    step_dir = run_dir / "checkpoints" / str(FIXTURE["step"])
    assert sorted(p.name for p in step_dir.iterdir()) == FIXTURE["step_files"]
    written = json.loads((step_dir / "state" / "_METADATA").read_text())
    assert written["tree_metadata"] == FIXTURE["tree_metadata"]  # byte layout as c931687 wrote
    assert {k: v for k, v in written.items() if k != "tree_metadata"} == FIXTURE["state_metadata"]
    with open(TRAIN, encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(16), f, strict=False)]

    # The run length the checkpoint already reached: resume, train nothing, export those weights.
    done = rx.RewardTrainer(
        config(tmp_path, steps=FIXTURE["step"]),
        tokenizer,
        model=tiny_llama(tokenizer),
        train_dataset=rows,
    )
    result = done.train()
    assert (
        f"resuming run {FIXTURE['run_name']} from step {FIXTURE['step']}" in capfd.readouterr().err
    )
    restored = jax.tree.leaves(done.state.params)
    saved = jax.tree.leaves(state["params"])
    assert len(restored) == len(saved) == 12
    for a, b in zip(restored, saved, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(jax.device_get(done.state.step)) == FIXTURE["step"]
    exported = rx.AutoRewardModel.from_pretrained(result.export_dir)
    np.testing.assert_array_equal(
        np.asarray(exported.score.kernel[...]),
        np.asarray(state["params"]["score"]["kernel"]["value"]),
    )

    # Longer: the old run continues from its data position, one more logged step, a new checkpoint.
    longer = rx.RewardTrainer(
        config(tmp_path, steps=FIXTURE["step"] + 1),
        tokenizer,
        model=tiny_llama(tokenizer),
        train_dataset=rows,
    )
    longer.train()
    metrics = read_metrics(run_dir)
    train_steps = [r["step"] for r in metrics if r["split"] == "train"]
    assert train_steps == [1, 2, 3]  # c931687's two rows, then today's
    resumes = [r for r in metrics if r["split"] == "resume"]
    assert [r["step"] for r in resumes] == [FIXTURE["step"], FIXTURE["step"]]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2",
        "3",
    ]
    assert longer.train_loader.get_state()["batches_done"] == 3

    # `rewardax export --checkpoint` reads c931687's extra (its config lacks today's fields).
    out = tmp_path / "exported"
    from rewardax.cli import main

    assert main(["export", "--checkpoint", str(step_dir), "--output", str(out)]) == 0
    again = rx.AutoRewardModel.from_pretrained(out)
    np.testing.assert_array_equal(
        np.asarray(again.model.norm.weight[...]),
        np.asarray(state["params"]["model"]["norm"]["weight"]["value"]),
    )
