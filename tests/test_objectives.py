"""Multi-objective heads (issue #31): named-score rows (`scores: {objective: value}`), the
config (model.objectives, train.objective_weights), the weighted per-objective loss and its
accumulation, a tiny run, export and reload with the names, eval per objective, `rewardax score`."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import optax
import pytest
import scipy.stats
from flax import nnx

import rewardax as rx
from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax import losses
from rewardax.config import objective_weights
from rewardax.data import DataConfig, PreferenceLoader
from rewardax.errors import ConfigError, DataError
from rewardax.models.reward import RewardModel
from rewardax.state import RewardState
from rewardax.steps import group_logits, make_train_step
from test_cli import run_main
from test_groups import train_in_both_layouts
from test_steps import TINY, flat_params
from test_trainer import HELDOUT, TRAIN, make_config, rows

NAMES = ["helpfulness", "correctness"]


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def named_rows(pairs):
    """Two named-score rows per VADER pair: helpfulness = the sentence's rating, correctness =
    its length in words / 10; every third row leaves correctness out (a masked objective)."""
    out = []
    for p in pairs:
        for side in ("chosen", "rejected"):
            scores = {"helpfulness": p[f"score_{side}"], "correctness": len(p[side].split()) / 10}
            if len(out) % 3 == 2:
                del scores["correctness"]
            out.append({"prompt": p["prompt"], "response": p[side], "scores": scores})
    return out


def loader(rows_, tokenizer, **kwargs):
    config = DataConfig(max_sequence_length=64)
    return PreferenceLoader(
        rows_, tokenizer, config, batch_size=4, seed=0, loss="mse", objectives=NAMES, **kwargs
    )


def objective_config(tmp_path, **overrides):
    settings = dict(loss="mse", objectives=NAMES, bucket_lengths=[64])
    settings.update(overrides)
    return make_config(tmp_path, **settings)


# ------------------------------------------------------------------------------------- data


def test_named_score_rows_batch_their_scores_and_mask_what_a_row_leaves_out(tokenizer):
    data = named_rows(rows(TRAIN, 2))  # 4 rows; row 2 has no correctness
    batch = next(iter(loader(data, tokenizer, num_epochs=1)))
    assert batch["scores"].shape == batch["score_mask"].shape == (4, 1, 2)
    assert batch["input_ids"].shape[:2] == (4, 1)
    by_helpfulness = {float(np.float32(r["scores"]["helpfulness"])): r for r in data}
    for i in range(4):
        row = by_helpfulness[float(batch["scores"][i, 0, 0])]
        want_correctness = row["scores"].get("correctness")
        if want_correctness is None:
            assert batch["score_mask"][i, 0].tolist() == [1.0, 0.0]
            assert batch["scores"][i, 0, 1] == 0.0  # never NaN on the device
        else:
            assert batch["score_mask"][i, 0].tolist() == [1.0, 1.0]
            assert batch["scores"][i, 0, 1] == pytest.approx(want_correctness)
    assert sorted(batch["score_mask"][:, 0, 1].tolist()) == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"scores": {"helpfulnes": 3}}, r"field 'scores.helpfulnes': not one of model\.objectives="
         r"\['helpfulness', 'correctness'\] \(did you mean 'helpfulness'\?\)"),
        ({"scores": {"helpfulness": float("nan")}},
         r"field 'scores.helpfulness': expected a finite number \(or null: not scored\), got nan"),
        ({"scores": {"helpfulness": "3"}}, r"field 'scores.helpfulness': expected a finite number"),
        ({"scores": {"helpfulness": None}}, r"field 'scores': scores none of the objectives"),
        ({"scores": [3, 4]}, r"field 'scores': expected a mapping \{objective: value\}"),
        ({"scores": None, "score": 3.0}, r"field 'score': model\.objectives=\['helpfulness', "
         r"'correctness'\] trains named scores; give `scores`"),
    ],
)  # fmt: skip
def test_bad_named_score_rows_name_the_row_field_and_fix(tokenizer, change, needle):
    data = named_rows(rows(TRAIN, 2))
    data[1] = {k: v for k, v in {**data[1], **change}.items() if v is not None}
    with pytest.raises(DataError, match=r"rows\[1\], " + needle):
        loader(data, tokenizer)


def test_named_scores_without_objectives_say_to_set_them(tokenizer):
    data = named_rows(rows(TRAIN, 2))
    config = DataConfig(max_sequence_length=64)
    with pytest.raises(DataError, match=r"rows\[0\], field 'scores': named scores train a head "
                       r"with one output per name: set model\.objectives"):  # fmt: skip
        PreferenceLoader(data, tokenizer, config, batch_size=4, seed=0, loss="mse")


# ----------------------------------------------------------------------------------- config


def test_config_objectives_head_width_weights_and_refusals(tmp_path):
    config = objective_config(tmp_path, objective_weights={"correctness": 0.25})
    config.validate()
    assert config.model.head_width == 2
    assert objective_weights(config) == {"helpfulness": 1.0, "correctness": 0.25}
    assert config.to_dict()["model"]["objectives"] == NAMES
    cli = config.with_overrides(["train.objective_weights=helpfulness=2,correctness=0.5"])
    assert objective_weights(cli) == {"helpfulness": 2.0, "correctness": 0.5}
    # Defaults stay out of the dict (and so out of existing run names).
    plain = make_config(tmp_path).to_dict()
    assert "objectives" not in plain["model"] and "objective_weights" not in plain["train"]
    problems = {
        "model.num_labels=3": r"model\.objectives names 2 objectives, so the head has 2 outputs; "
        r"model\.num_labels=3 conflicts",
        "train.objective_weights=helpfulnes=2": r"train\.objective_weights names 'helpfulnes', "
        r"which is not one of model\.objectives=.*\(did you mean 'helpfulness'\?\)",
        "train.objective_weights=correctness=-1": r"correctness=-1\.0 must be finite and ≥ 0",
        "train.loss=gaussian_nll": r"model\.objectives trains one head output per objective with "
        r"train\.loss=mse",
    }
    for override, message in problems.items():
        with pytest.raises(ConfigError, match=message):
            config.with_overrides([override]).validate()
    assert config.with_overrides(["model.num_labels=2"]).validate() is not False


# ------------------------------------------------------------------------------- the losses


def test_objective_sums_by_hand_and_the_weighted_loss():
    outputs = np.array([[[1.0, 0.0]], [[2.0, 2.0]], [[5.0, 5.0]]], np.float32)
    scores = np.array([[[0.0, 1.0]], [[1.0, 0.0]], [[0.0, 0.0]]], np.float32)
    mask = np.array([[[1.0, 1.0]], [[1.0, 0.0]], [[1.0, 1.0]]], np.float32)
    response_mask = np.ones((3, 1), np.float32)
    row_mask = np.array([1.0, 1.0, 0.0], np.float32)  # the third row is padding
    sums = losses.objective_metric_sums(outputs, scores, mask, response_mask, row_mask, ["a", "b"])
    # a: (1-0)² + (2-1)² over 2 rows; b: (0-1)² over 1 row (row 2 does not score b).
    assert float(sums["loss/a"]) == 2.0 and float(sums["num_rows/a"]) == 2.0
    assert float(sums["loss/b"]) == 1.0 and float(sums["num_rows/b"]) == 1.0
    assert float(sums["num_rows"]) == 2.0 and float(sums["reward"]) == 3.0
    metrics = losses.objective_metrics_from_sums(sums, {"a": 0.5, "b": 2.0})
    assert float(metrics["mse/a"]) == 1.0 and float(metrics["mse/b"]) == 1.0
    assert float(metrics["loss"]) == pytest.approx(0.5 * 1.0 + 2.0 * 1.0)


def named_batch(rng, rows_, length=10):
    ids = rng.integers(1, TINY.vocab_size, size=(rows_, 1, length)).astype(np.int32)
    lengths = rng.integers(3, length + 1, size=(rows_, 1))
    attention = (np.arange(length)[None, None, :] < lengths[..., None]).astype(np.int32)
    mask = np.ones((rows_, 1, 2), np.float32)
    mask[::3, 0, 1] = 0.0  # rows without the second objective
    mask[4, 0, 0] = 0.0  # a row without the first
    scores = rng.normal(size=(rows_, 1, 2)).astype(np.float32) * mask
    row_mask = np.ones(rows_, np.float32)
    row_mask[[1, 6]] = 0.0  # padding rows, uneven over microbatches
    return {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "reward_index": (lengths - 1).astype(np.int32),
        "response_mask": np.ones((rows_, 1), np.float32),
        "scores": scores,
        "score_mask": mask,
        "row_mask": row_mask,
    }


def recomputed(outputs, batch, weights):
    """The weighted loss by hand: per objective (head output i, in `weights`' order; a weight of
    0 leaves one out) the mean squared error over the real rows that score it, then Σ w · that."""
    total = 0.0
    real = np.asarray(batch["row_mask"]) > 0
    for i, name in enumerate(weights):
        if weights[name] == 0:
            continue
        scored = real & (np.asarray(batch["score_mask"])[:, 0, i] > 0)
        error = (outputs[:, 0, i] - np.asarray(batch["scores"])[:, 0, i])[scored]
        total += weights[name] * float(np.mean(np.square(error.astype(np.float64))))
    return total


def test_objective_step_equals_the_hand_loss_and_accumulation_is_exact():
    config = dataclasses.replace(TINY, num_labels=2)
    batch = named_batch(np.random.default_rng(0), 8)
    weights = {"a": 1.0, "b": 0.25}

    def fresh():
        return RewardState.create(RewardModel(config, rngs=nnx.Rngs(0)), optax.sgd(0.1), seed=0)

    state = fresh()
    outputs = np.asarray(
        jax.jit(
            lambda arrays: group_logits(
                nnx.merge(state.graphdef, arrays["params"], arrays["rest"]), batch
            )
        )(state.arrays())
    )
    results = {}
    for steps in (1, 2):
        step = make_train_step(
            state.graphdef, optax.sgd(0.1), optax.constant_schedule(0.1),
            accumulation_steps=steps, loss="mse", objective_weights=weights,
        )  # fmt: skip
        results[steps] = jax.jit(step)(fresh().arrays(), batch)
    (one, m1), (two, m2) = results[1], results[2]
    assert float(m1["loss"]) == pytest.approx(recomputed(outputs, batch, weights), rel=1e-5)
    assert float(m1["mse/b"]) == pytest.approx(
        recomputed(outputs, batch, {"a": 0.0, "b": 1.0}), rel=1e-5
    )
    assert float(m1["num_rows"]) == 6.0
    before = flat_params(state.arrays())
    update = flat_params(one) - before
    assert np.abs(update).max() > 1e-4
    np.testing.assert_allclose(flat_params(two) - before, update, atol=1e-6, rtol=1e-4)
    for key in m1:
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, atol=1e-6)
    # The weights change the gradient: b's weight 0 is objective a's loss alone.
    step = make_train_step(
        state.graphdef, optax.sgd(0.1), optax.constant_schedule(0.1), loss="mse",
        objective_weights={"a": 1.0, "b": 0.0},
    )  # fmt: skip
    _, m0 = jax.jit(step)(fresh().arrays(), batch)
    assert float(m0["loss"]) == pytest.approx(float(m1["mse/a"]), rel=1e-6)


# ------------------------------------------------------------------ a run, export, eval, score


def head_outputs(model, tokenizer, texts):
    """Independent reference: every head output of each text, tokenized here (+EOS, as training
    does) and run by `rewardax.scoring.RewardScorer` (its own padding and batching)."""
    from rewardax.scoring import RewardScorer

    scorer = RewardScorer(
        model, pad_id=tokenizer.eos_token_id, max_sequence_length=64, batch_size=32
    )
    return scorer.outputs(
        [np.asarray([*tokenizer(t).input_ids, tokenizer.eos_token_id]) for t in texts]
    )


def two_head_model(tokenizer, seed=0):
    base = tiny_llama(tokenizer)
    return RewardModel(dataclasses.replace(base.config, num_labels=2), rngs=nnx.Rngs(seed))


@pytest.mark.slow  # ~12-22 s: the default suite stays under 15 min
def test_named_scores_train_the_same_in_shared_prompt_rows(tokenizer, tmp_path):
    """Named scores (a masked objective in every third row) through K-branch rows
    (`pack_group_records` adds their score_mask): the padded layout's losses and parameters."""
    data = named_rows(rows(TRAIN, 12))
    settings = dict(loss="mse", objectives=NAMES)
    train_in_both_layouts(tokenizer, tmp_path, data, lambda: two_head_model(tokenizer), **settings)


def test_a_tiny_two_objective_run_trains_exports_and_reloads(tokenizer, tmp_path):
    """3 steps whose logged loss equals the hand loss over the outputs the model gave each
    batch; the export carries the names (transformers reads them) and reloads with the same
    outputs."""
    data = named_rows(rows(TRAIN, 24))
    heldout = named_rows(rows(HELDOUT, 8))
    weights = {"helpfulness": 1.0, "correctness": 0.5}
    config = objective_config(
        tmp_path, max_training_steps=3, run_name="objectives",
        objective_weights={"correctness": 0.5},
    )  # fmt: skip
    trainer = rx.RewardTrainer(
        config,
        tokenizer,
        model=two_head_model(tokenizer),
        train_dataset=data,
    )
    fns = trainer.configure_functions()
    graphdef = trainer.state.graphdef
    logits_of = jax.jit(
        lambda arrays, b: group_logits(nnx.merge(graphdef, arrays["params"], arrays["rest"]), b)
    )
    seen = []

    def step(arrays, batch):
        outputs = np.asarray(logits_of(arrays, batch))  # before the step donates the arrays
        new, metrics = fns.train_step(arrays, batch)
        seen.append((outputs, jax.device_get(batch), jax.device_get(metrics)))
        return new, metrics

    trainer._functions = fns._replace(train_step=step)
    result = trainer.train()
    assert len(seen) == 3
    for outputs, batch, metrics in seen:
        assert float(metrics["loss"]) == pytest.approx(
            recomputed(outputs, batch, weights), rel=1e-5
        )
        for name in NAMES:
            one = recomputed(outputs, batch, {n: float(n == name) for n in NAMES})
            assert float(metrics[f"mse/{name}"]) == pytest.approx(one, rel=1e-5)
    assert result.metrics["train"]["loss"] == pytest.approx(float(seen[-1][2]["loss"]), rel=1e-6)
    assert "mse/correctness" in result.metrics["train"]

    # Export: names in config.json, transformers' view of them, the same outputs on reload.
    export = result.export_dir
    hf = json.loads((export / "config.json").read_text())
    assert hf["num_labels"] == 2
    assert hf["id2label"] == {"0": "helpfulness", "1": "correctness"}
    assert hf["label2id"] == {"helpfulness": 0, "correctness": 1}
    reloaded = rx.AutoRewardModel.from_pretrained(export, num_labels=2, dtype="float32")
    assert reloaded.config.label_names == tuple(NAMES)
    assert rx.ModelConfig.from_hf_dict(reloaded.config.to_hf_dict()) == reloaded.config
    ids = np.asarray([[*tokenizer(heldout[0]["response"]).input_ids, tokenizer.eos_token_id]])
    trained = trainer.state.model
    np.testing.assert_allclose(
        np.asarray(reloaded(ids).logits), np.asarray(trained(ids).logits), atol=1e-5
    )
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoConfig.from_pretrained(export)
    assert auto.num_labels == 2 and auto.id2label == {0: "helpfulness", 1: "correctness"}

    # `rewardax export` of the run's last checkpoint keeps them too.
    from rewardax.export import export_checkpoint

    export_checkpoint(result.run_dir / "checkpoints", tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["id2label"] == hf["id2label"] and again["num_labels"] == 2


def test_eval_reports_each_objective_from_independent_outputs(tokenizer, tmp_path):
    """Spearman, Kendall and MSE per objective, each over the rows that score it, equal those of
    head outputs computed apart from the trainer."""
    heldout = named_rows(rows(HELDOUT, 8))
    model = two_head_model(tokenizer, seed=3)
    trainer = rx.RewardTrainer(
        objective_config(tmp_path, run_name="eval"),
        tokenizer,
        model=model,
        eval_dataset={"heldout": heldout},
    )
    metrics = trainer.evaluate()["heldout"]
    want = head_outputs(model, tokenizer, [r["prompt"] + r["response"] for r in heldout])
    for i, name in enumerate(NAMES):
        scored = [j for j, r in enumerate(heldout) if name in r["scores"]]
        target = np.array([heldout[j]["scores"][name] for j in scored])
        got = metrics["objectives"][name]
        assert got["num_rows"] == len(scored)
        assert got["spearman"] == pytest.approx(
            scipy.stats.spearmanr(want[scored, i], target).statistic, abs=1e-6
        )
        assert got["kendall_tau"] == pytest.approx(
            scipy.stats.kendalltau(want[scored, i], target).statistic, abs=1e-6
        )
        assert got["mse"] == pytest.approx(np.mean((want[scored, i] - target) ** 2), rel=1e-4)
    assert metrics["spearman"] == metrics["objectives"]["helpfulness"]["spearman"]


def test_cli_score_and_eval_name_each_objective(tokenizer, tmp_path, capsys):
    """A two-objective export outside any run dir: `rewardax score` writes `reward` (the first
    objective) and `rewards` by name; `rewardax eval` reports each objective."""
    model = two_head_model(tokenizer, seed=5)
    model = RewardModel(
        dataclasses.replace(model.config, label_names=tuple(NAMES)), rngs=nnx.Rngs(5)
    )
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir, tokenizer=tokenizer)
    data = named_rows(rows(HELDOUT, 4))
    path = tmp_path / "named.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    code, _, err = run_main(capsys, ["score", "--model", str(model_dir), "--input", str(path),
                                     "--output", str(tmp_path / "scored.jsonl")])  # fmt: skip
    assert code == 0, err
    scored = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    texts = [r["prompt"] + r["response"] for r in data]
    want = head_outputs(model, tokenizer, texts)
    for row, expected in zip(scored, want, strict=True):
        assert list(row["rewards"]) == NAMES
        assert row["rewards"]["helpfulness"] == pytest.approx(expected[0], abs=1e-5)
        assert row["rewards"]["correctness"] == pytest.approx(expected[1], abs=1e-5)
        assert row["reward"] == row["rewards"]["helpfulness"]

    code, out, err = run_main(capsys, ["eval", "--model", str(model_dir), "--data", str(path)])
    assert code == 0, err
    metrics = json.loads(out.strip().splitlines()[-1])["metrics"]
    scored_rows = [j for j, r in enumerate(data) if "correctness" in r["scores"]]
    target = np.array([data[j]["scores"]["correctness"] for j in scored_rows])
    got = metrics["objectives"]["correctness"]
    assert got["num_rows"] == len(scored_rows) and "correctness (" in err
    assert got["mse"] == pytest.approx(np.mean((want[scored_rows, 1] - target) ** 2), rel=1e-4)
    assert math.isfinite(metrics["objectives"]["helpfulness"]["spearman"])

    # rewardax serve names the objectives in GET /info, serves the first as the reward and
    # every one beside it (its routes: tests/test_serve.py).
    from rewardax.serve.model import ServingModel

    serving = ServingModel(model_dir, overrides=["data.max_sequence_length=64"])
    assert serving.info()["objectives"] == NAMES
    ids = [np.asarray([*tokenizer(t).input_ids, tokenizer.eos_token_id]) for t in texts[:2]]
    np.testing.assert_allclose(serving.rewards(ids), want[:2, 0], atol=1e-5)
    rewards, objectives = serving.score(ids)
    np.testing.assert_allclose(objectives, want[:2], atol=1e-5)
    np.testing.assert_array_equal(rewards, objectives[:, 0])


def test_model_config_label_names_round_trip_and_refusals():
    named = dataclasses.replace(TINY, num_labels=2, label_names=("helpful", "safe"))
    d = named.to_hf_dict()
    assert d["id2label"] == {"0": "helpful", "1": "safe"}
    assert d["label2id"] == {"helpful": 0, "safe": 1}
    assert rx.ModelConfig.from_hf_dict(d) == named
    plain = dataclasses.replace(TINY, num_labels=2)
    assert plain.to_hf_dict()["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}
    assert rx.ModelConfig.from_hf_dict(plain.to_hf_dict()).label_names is None
    for names in (("helpful",), ("a", "a")):
        with pytest.raises(ConfigError, match=r"label_names=.* must be 2 distinct names"):
            plain.replace(label_names=names)
