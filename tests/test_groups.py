"""Groups of K responses and score rows (issue #31): their data format and errors, the group
train step against `rewardax.ranking_losses`, training with each group loss, and evaluation."""

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
from rewardax import data as rdata
from rewardax import losses, ranking_losses
from rewardax.data import DataConfig, PreferenceLoader
from rewardax.errors import ConfigError, DataError
from rewardax.models.reward import RewardModel
from rewardax.state import RewardState
from rewardax.steps import group_logits, group_sums, make_train_step
from test_cli import run_main
from test_steps import TINY, flat_params
from test_trainer import HELDOUT, TRAIN, make_config, rows

PROMPT = "Write one sentence about a film you saw.\n"


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def score_rows(pairs):
    """Two score rows per VADER pair: each sentence with its mean human rating."""
    return [
        {"prompt": p["prompt"], "response": p[side], "score": p[f"score_{side}"]}
        for p in pairs
        for side in ("chosen", "rejected")
    ]


def ranked_rows(pairs):
    """Two VADER pairs -> one row ranking their 4 sentences by rating; every third row keeps 3
    (rows with fewer responses than K are padded)."""
    out = []
    for i, (a, b) in enumerate(zip(pairs[0::2], pairs[1::2], strict=False)):
        sentences = [a["chosen"], a["rejected"], b["chosen"], b["rejected"]]
        ratings = [a["score_chosen"], a["score_rejected"], b["score_chosen"], b["score_rejected"]]
        k = 3 if i % 3 == 2 else 4
        ranks = np.argsort(np.argsort(-np.asarray(ratings[:k])))
        out.append({"prompt": a["prompt"], "responses": sentences[:k], "ranks": ranks.tolist()})
    return out


def loader(rows_, tokenizer, loss, **kwargs):
    config = DataConfig(max_sequence_length=64)
    return PreferenceLoader(rows_, tokenizer, config, batch_size=4, seed=0, loss=loss, **kwargs)


# ------------------------------------------------------------------------------------- data


def test_score_rows_make_group_batches_of_one_response(tokenizer):
    data = score_rows(rows(TRAIN, 4))
    batch = next(iter(loader(data, tokenizer, "mse", num_epochs=1)))
    assert batch["input_ids"].shape[:2] == (4, 1)
    assert set(batch) == {
        "input_ids", "attention_mask", "reward_index", "response_mask", "scores", "row_mask"
    }  # fmt: skip
    # Each response is tokenized as `rewardax score` does: prompt + response + EOS.
    scores = batch["scores"][:, 0]
    for i, score in enumerate(scores):
        row = next(r for r in data if np.float32(r["score"]) == score)
        want = [*tokenizer(row["prompt"] + row["response"]).input_ids, tokenizer.eos_token_id]
        length = int(batch["attention_mask"][i, 0].sum())
        assert batch["input_ids"][i, 0, :length].tolist() == want
        assert batch["reward_index"][i, 0] == length - 1
    np.testing.assert_array_equal(batch["row_mask"], 1.0)


def test_ranked_rows_make_group_batches_padded_to_the_largest_row(tokenizer):
    data = ranked_rows(rows(TRAIN, 12))  # 6 rows: 4, 4, 3, 4, 4, 3 responses
    batches = list(loader(data, tokenizer, "plackett_luce", num_epochs=1, drop_remainder=False))
    assert all(b["input_ids"].shape[:2] == (4, 4) for b in batches)
    real = np.concatenate([b["row_mask"] for b in batches]) > 0
    masks = np.concatenate([b["response_mask"] for b in batches])[real]
    ranks = np.concatenate([b["ranks"] for b in batches])[real]
    assert sorted(masks.sum(1).tolist()) == [3, 3, 4, 4, 4, 4]
    # The ranks of each row, in order; a padded response has mask 0 and attends one position.
    want = sorted(tuple(r["ranks"]) for r in data)
    got = sorted(tuple(int(x) for x in ranks[i][masks[i] > 0]) for i in range(len(ranks)))
    assert got == want
    short = next(b for b in batches if (b["response_mask"][b["row_mask"] > 0] == 0).any())
    i, k = np.argwhere((short["response_mask"] == 0) & (short["row_mask"][:, None] > 0))[0]
    assert short["attention_mask"][i, k].tolist()[:2] == [1, 0]


def test_a_group_loader_resumes_at_the_next_batch(tokenizer):
    data = ranked_rows(rows(TRAIN, 32))  # 16 rows, 8 batches of 2, length windows of 4 rows
    config = DataConfig(max_sequence_length=64, length_group_window=4)

    def make():
        return PreferenceLoader(
            data, tokenizer, config, batch_size=2, seed=3, loss="plackett_luce", num_epochs=1
        )

    whole = [b["input_ids"] for b in make()]
    first = make()
    batches = iter(first)
    head = [next(batches)["input_ids"] for _ in range(3)]
    resumed = make()
    resumed.set_state(first.get_state())
    tail = [b["input_ids"] for b in resumed]
    assert len(whole) == 8 == len(head) + len(tail)
    for a, b in zip(whole, head + tail, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"score": float("nan")}, r"field 'score': expected a finite number, got nan"),
        ({"score": "4.5"}, r"field 'score': expected a finite number, got '4.5'"),
        ({"score": True}, r"field 'score': expected a finite number, got True"),
        ({"score": None}, r"field 'score': missing; give the response's score"),
        ({"response": None}, r"field 'response': missing; a score row needs the response"),
        ({"response": ""}, r"field 'response': expected a non-empty string or a list of chat"),
        ({"response": 7}, r"field 'response': expected a non-empty string or a list of chat"),
    ],
)
def test_bad_score_rows_name_the_row_and_field(tokenizer, change, needle):
    data = score_rows(rows(TRAIN, 2))
    data[1] = {**data[1], **change}
    with pytest.raises(DataError, match=r"rows\[1\], " + needle):
        loader(data, tokenizer, "mse")


def test_mixed_rows_are_refused_naming_the_row(tokenizer):
    scores, pairs = score_rows(rows(TRAIN, 2)), rows(TRAIN, 3)
    with pytest.raises(DataError, match=r"rows\[2\]: this dataset's rows are score rows .* "
                       r"this row does not .*'chosen'"):  # fmt: skip
        loader([*scores[:2], pairs[0]], tokenizer, "mse")
    with pytest.raises(DataError, match=r"rows\[3\], field 'score': the dataset is in "
                       r"standard pair format .* this row is a score row"):  # fmt: skip
        list(loader([*pairs, scores[0]], tokenizer, "bradley_terry", num_epochs=1))


def group_rows_of_every_kind(pairs, layout):
    """Group rows as `ResponseGroups` hands them to `GroupProcessor` (`responses` + `targets`):
    text and chat responses, a long one, and bad ones among them."""
    user = [{"role": "user", "content": "Describe the film in one line."}]
    sentences = [p[side] for p in pairs for side in ("chosen", "rejected")]
    long = "A long and winding sentence about a film. " * 8
    bad_chat = [{"role": "assistant", "content": 3}]
    if layout == "scores":
        responses = [
            [sentences[0]], [sentences[1]], [""], [long], [[{"role": "assistant", "content": "Ok."}]],
            [sentences[2]], [bad_chat], [sentences[3]],
        ]  # fmt: skip
        prompts = [PROMPT, PROMPT, PROMPT, PROMPT, user, PROMPT, None, None]
    else:
        chat = [[{"role": "assistant", "content": s}] for s in sentences[:3]]
        responses = [
            sentences[0:4], sentences[1:4], [sentences[0], sentences[1], ""], chat,
            [sentences[2], long, sentences[3]], chat[:2], [sentences[3], sentences[0], bad_chat],
            sentences[4:8],
        ]  # fmt: skip
        # Row 5: chat responses under a string prompt (refused before any is tokenized).
        prompts = [PROMPT, PROMPT, PROMPT, user, PROMPT, PROMPT, None, None]
    return [
        {"prompt": prompt, "responses": rs, "targets": list(range(len(rs)))}
        for prompt, rs in zip(prompts, responses, strict=True)
    ]


@pytest.mark.parametrize("layout", ["ranks", "scores"])
@pytest.mark.parametrize("mode", ["keep_end", "filter"])
def test_a_chunk_of_group_rows_gives_the_records_of_each_row_alone(tokenizer, layout, mode):
    """`process_many` tokenizes all responses of a chunk together; each record (or dropped
    record, its message naming the same field) equals that of its row processed alone."""
    from rewardax.data.groups import GroupProcessor

    config = DataConfig(max_sequence_length=64, truncation_mode=mode)
    processor = GroupProcessor(tokenizer, config, layout)
    data = group_rows_of_every_kind(rows(TRAIN, 4), layout)

    def where(i):
        return f"rows[{i}]"

    indices = [10 + i for i in range(len(data))]
    together = processor.process_many(data, indices, where)
    alone = [processor.process(row, i, where(i)) for row, i in zip(data, indices, strict=True)]
    assert len(together) == len(alone)
    for got, want in zip(together, alone, strict=True):
        assert set(got) == set(want)
        if "dropped" in want:
            assert got == want
            continue
        assert got["index"] == want["index"] and got["truncated"] == want["truncated"]
        np.testing.assert_array_equal(got["targets"], want["targets"])
        assert [r.tolist() for r in got["responses"]] == [r.tolist() for r in want["responses"]]
    # What the rows are there for: fields named as the source row names them, long rows cut or
    # filtered, and the good rows kept.
    messages = {r["index"]: r["message"] for r in together if "dropped" in r}
    field = "response" if layout == "scores" else "responses[2]"
    assert messages[12].startswith(f"rows[12], field '{field}': expected a non-empty string")
    assert messages[16].startswith(f"rows[16], field '{field}'")
    if layout == "ranks":
        assert messages[15].startswith("rows[15], field 'prompt'")
    assert ("too_long" in " ".join(messages.values())) == (mode == "filter")
    assert any(r.get("truncated") for r in together) == (mode == "keep_end")
    assert sum("dropped" not in r for r in together) >= 3


@pytest.mark.parametrize(
    ("data", "loss", "fits"),
    [
        ("scores", "bradley_terry", "have no pairs: use train.loss=mse or gaussian_nll"),
        ("scores", "plackett_luce", "use train.loss=mse or gaussian_nll"),
        ("ranked", "mse", "bradley_terry .*, plackett_luce, all_pairs_bradley_terry or davidson"),
        ("pairs", "all_pairs_bradley_terry", "use train.loss=bradley_terry"),
        ("pairs", "gaussian_nll", "use train.loss=bradley_terry"),
    ],
)
def test_a_loss_that_does_not_fit_the_data_is_refused_up_front(tokenizer, data, loss, fits):
    pairs = rows(TRAIN, 4)
    source = {"scores": score_rows(pairs), "ranked": ranked_rows(pairs), "pairs": pairs}[data]
    with pytest.raises(DataError, match=fits):
        loader(source, tokenizer, loss)


def test_rows_over_max_responses_and_packed_layouts_are_refused(tokenizer, tmp_path):
    data = ranked_rows(rows(TRAIN, 4))
    with pytest.raises(DataError, match=r"rows\[0\]: 4 responses, more than train.max_responses=3"):
        loader(data, tokenizer, "plackett_luce", max_responses=3)
    with pytest.raises(ConfigError, match=r"data\.layout=padded or shared_prompt lays out"):
        make_config(tmp_path, loss="plackett_luce", layout="packed").validate()
    with pytest.raises(ConfigError, match=r"padded or shared_prompt .*not packed"):
        PreferenceLoader(
            data, tokenizer, DataConfig(layout="packed"), batch_size=4, seed=0, loss="plackett_luce"
        )
    with pytest.raises(ConfigError, match=r"set model\.num_labels=2"):
        make_config(tmp_path, loss="gaussian_nll").validate()


def test_the_default_loss_keeps_existing_configs_and_run_names(tmp_path):
    from rewardax.cli import DEFAULT_CONFIG

    config = rx.RewardConfig.from_yaml(DEFAULT_CONFIG)
    assert "loss" not in config.to_dict()["train"] and "max_responses" not in config.to_yaml()
    changed = config.with_overrides(["train.loss=plackett_luce"])
    assert changed.to_dict()["train"]["loss"] == "plackett_luce"
    assert rx.RewardConfig.from_dict(changed.to_dict()).train.loss == "plackett_luce"


# ------------------------------------------------------------------------------- the losses


def test_group_sums_equal_the_pure_functions_on_hand_made_rewards():
    rewards = np.array([[2.0, 1.0, 0.0], [0.5, 3.0, np.nan], [9.0, 9.0, 9.0]], np.float32)
    ranks = np.array([[0, 1, 2], [0, 1, 0], [0, 0, 0]], np.float32)
    response_mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]], np.float32)
    row_mask = np.array([1, 1, 0], np.float32)  # the third row is padding
    batch = {"ranks": ranks, "response_mask": response_mask, "row_mask": row_mask}
    logits = np.nan_to_num(rewards)[..., None]
    pl = group_sums(logits, batch, "plackett_luce")
    # Row 1: the docstring's hand value; row 2: -log σ(0.5 - 3) (two responses = Bradley-Terry).
    row2 = -math.log(1 / (1 + math.exp(2.5)))
    assert float(pl["loss"]) == pytest.approx(0.7209 + row2, abs=1e-4)
    assert float(pl["num_rows"]) == 2 and float(pl["num_ranked_pairs"]) == 4
    assert float(pl["correct_pairs"]) == 3  # row 1 all right, row 2 wrong
    apbt = group_sums(logits, batch, "all_pairs_bradley_terry")
    want = ranking_losses.all_pairs_bradley_terry_loss(rewards, ranks, response_mask)
    assert float(apbt["loss"]) == pytest.approx(float(want[0] + want[1]), rel=1e-6)
    assert float(losses.group_metrics_from_sums(apbt)["loss"]) == pytest.approx(
        float(want[0] + want[1]) / 2, rel=1e-6
    )

    # Row 1 has no tie: each of its 3 preferred pairs (d = 1, 2, 1) costs logsumexp(d/2, -d/2, θ)
    # - d/2; row 2's one pair (ranks 0 and 1) d = -2.5. θ = log 2 here.
    theta = math.log(2.0)

    def preferred(d):
        return math.log(math.exp(d / 2) + math.exp(-d / 2) + math.exp(theta)) - d / 2

    dav = group_sums(logits, batch, "davidson", theta)
    row1 = (2 * preferred(1.0) + preferred(2.0)) / 3
    assert float(dav["loss"]) == pytest.approx(row1 + preferred(-2.5), rel=1e-5)
    assert float(dav["correct_pairs"]) == 3 and float(dav["num_ranked_pairs"]) == 4

    scores = {"scores": np.array([[1.0], [3.0], [0.0]], np.float32), **batch}
    scores["response_mask"] = np.ones((3, 1), np.float32)
    predicted = np.array([[[0.5, 0.0]], [[1.0, math.log(4.0)]], [[7.0, 0.0]]], np.float32)
    mse = losses.group_metrics_from_sums(group_sums(predicted, scores, "mse"))
    assert float(mse["loss"]) == pytest.approx((0.25 + 4.0) / 2) == float(mse["mse"])
    nll = group_sums(predicted, scores, "gaussian_nll")
    # Row 2: the docstring's value ½(log 2π + log 4 + 1); row 1: ½(log 2π + 0.25).
    half_log_2pi = 0.5 * math.log(2 * math.pi)
    assert float(nll["loss"]) == pytest.approx(2.1121 + half_log_2pi + 0.125, abs=1e-4)
    with pytest.raises(ConfigError, match=r"set model\.num_labels=2"):
        group_sums(predicted[..., :1], scores, "gaussian_nll")
    no_ranks = {k: v for k, v in scores.items() if k != "ranks"}
    with pytest.raises(ConfigError, match=r"needs `ranks`.*fits mse or gaussian_nll"):
        group_sums(predicted, no_ranks, "plackett_luce")


def random_group_batch(rng, rows_, k, length=10, loss="plackett_luce"):
    ids = rng.integers(1, TINY.vocab_size, size=(rows_, k, length)).astype(np.int32)
    lengths = rng.integers(3, length + 1, size=(rows_, k))
    response_mask = np.ones((rows_, k), np.float32)
    if k > 1:
        response_mask[::3, -1] = 0.0  # rows with fewer responses
        lengths[::3, -1] = 1
    attention = (np.arange(length)[None, None, :] < lengths[..., None]).astype(np.int32)
    batch = {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "reward_index": (lengths - 1).astype(np.int32),
        "response_mask": response_mask,
        "row_mask": np.ones(rows_, np.float32),
    }
    if loss in losses.SCORE_LOSSES:
        batch["scores"] = rng.normal(size=(rows_, k)).astype(np.float32)
    else:
        batch["ranks"] = np.stack([rng.permutation(k) for _ in range(rows_)]).astype(np.float32)
    batch["row_mask"][[1, 6]] = 0.0  # padding rows, uneven over microbatches
    return batch


def state_for(loss):
    config = dataclasses.replace(TINY, num_labels=2) if loss == "gaussian_nll" else TINY
    return RewardState.create(RewardModel(config, rngs=nnx.Rngs(0)), optax.sgd(0.1), seed=0)


def recomputed_loss(logits, batch, loss):
    """The batch's loss from the pure function of `rewardax.ranking_losses`, mean over real rows."""
    r = logits[..., 0]
    if loss == "plackett_luce":
        per_row = ranking_losses.plackett_luce_loss(r, batch["ranks"], batch["response_mask"])
    elif loss == "all_pairs_bradley_terry":
        per_row = ranking_losses.all_pairs_bradley_terry_loss(
            r, batch["ranks"], batch["response_mask"]
        )
    elif loss == "davidson":  # at the default θ = 0
        per_row = ranking_losses.all_pairs_davidson_loss(
            r, batch["ranks"], batch["response_mask"], 0.0
        )
    elif loss == "mse":
        per_row = ranking_losses.mse_loss(r[:, 0], batch["scores"][:, 0])
    else:
        per_row = ranking_losses.gaussian_nll_loss(r[:, 0], batch["scores"][:, 0], logits[:, 0, 1])
    real = np.asarray(batch["row_mask"]) > 0
    return float(np.asarray(per_row)[real].mean())


@pytest.mark.parametrize("loss", losses.GROUP_LOSSES)
def test_group_step_loss_matches_the_pure_function_and_accumulation_is_exact(loss):
    k = 1 if loss in losses.SCORE_LOSSES else 3
    batch = random_group_batch(np.random.default_rng(0), 8, k, loss=loss)
    state = state_for(loss)

    def logits_of(arrays, b):
        return group_logits(nnx.merge(state.graphdef, arrays["params"], arrays["rest"]), b)

    logits = np.asarray(jax.jit(logits_of)(state.arrays(), batch))
    results = {}
    for steps in (1, 2):
        step = make_train_step(
            state.graphdef, optax.sgd(0.1), optax.constant_schedule(0.1),
            accumulation_steps=steps, loss=loss,
        )  # fmt: skip
        results[steps] = jax.jit(step)(state_for(loss).arrays(), batch)
    (one, m1), (two, m2) = results[1], results[2]
    assert float(m1["loss"]) == pytest.approx(recomputed_loss(logits, batch, loss), rel=1e-5)
    assert float(m1["num_rows"]) == 6.0
    before = flat_params(state.arrays())
    update = flat_params(one) - before
    assert np.abs(update).max() > 1e-4
    np.testing.assert_allclose(flat_params(two) - before, update, atol=1e-6, rtol=1e-4)
    for key in m1:
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- training runs


def tiny_model(tokenizer, loss):
    if loss != "gaussian_nll":
        return tiny_llama(tokenizer), {}
    model = tiny_llama(tokenizer)
    config = dataclasses.replace(model.config, num_labels=2)
    return RewardModel(config, rngs=nnx.Rngs(0)), {"num_labels": 2}


@pytest.mark.parametrize("loss", losses.GROUP_LOSSES)
def test_a_tiny_model_trains_with_each_group_loss(tokenizer, tmp_path, loss):
    """3 steps: each step's logged loss equals the pure function over the rewards the model
    (before the step) gives the batch it was fed, and the parameters move."""
    pairs = rows(TRAIN, 24)
    data = score_rows(pairs) if loss in losses.SCORE_LOSSES else ranked_rows(pairs)
    model, settings = tiny_model(tokenizer, loss)
    # One bucket length: one compiled step for the three batches.
    config = make_config(
        tmp_path, max_training_steps=3, run_name=loss, loss=loss, bucket_lengths=[64], **settings
    )
    trainer = rx.RewardTrainer(
        config,
        tokenizer,
        model=model,
        train_dataset=data,
    )
    fns = trainer.configure_functions()
    graphdef = trainer.state.graphdef
    logits_of = jax.jit(
        lambda arrays, b: group_logits(nnx.merge(graphdef, arrays["params"], arrays["rest"]), b)
    )
    seen = []

    def step(arrays, batch):
        logits = np.asarray(logits_of(arrays, batch))  # before the step donates the arrays
        new, metrics = fns.train_step(arrays, batch)
        seen.append((logits, jax.device_get(batch), float(metrics["loss"])))
        return new, metrics

    trainer._functions = fns._replace(train_step=step)
    before = flat_params({"params": trainer.state.params})
    result = trainer.train()
    assert len(seen) == 3
    for logits, batch, logged in seen:
        assert logged == pytest.approx(recomputed_loss(logits, batch, loss), rel=1e-5)
    assert result.metrics["train"]["loss"] == pytest.approx(seen[-1][2], rel=1e-6)
    assert result.metrics["train"]["num_rows"] == 4
    after = flat_params({"params": trainer.state.params})
    assert np.abs(after - before).max() > 1e-4


def train_in_both_layouts(tokenizer, tmp_path, data, new_model, accumulation=1, **settings):
    """Three steps on `data` in data.layout=padded and shared_prompt (the same batches: no length
    grouping), each from `new_model()`; asserts the same losses and parameters, and fewer
    computed tokens in shared_prompt. ``accumulation``: shared_prompt's 4 groups a step as that
    many microbatches (padded takes them at once)."""
    found = {}
    for layout in ("padded", "shared_prompt"):
        steps = accumulation if layout == "shared_prompt" else 1
        config = make_config(
            tmp_path,
            max_training_steps=3,
            run_name=layout,
            layout=layout,
            length_group_window=1,
            per_device_train_batch_size=4 // steps,
            gradient_accumulation_steps=steps,
            **settings,
        )
        trainer = rx.RewardTrainer(config, tokenizer, model=new_model(), train_dataset=data)
        fns = trainer.configure_functions()
        seen = []

        def step(arrays, batch, fns=fns, seen=seen):
            new, metrics = fns.train_step(arrays, batch)
            seen.append((float(metrics["loss"]), rdata.token_counts(jax.device_get(batch))))
            return new, metrics

        trainer._functions = fns._replace(train_step=step)
        trainer.train()
        found[layout] = (seen, flat_params({"params": trainer.state.params}))
    (padded, padded_params), (shared, shared_params) = found["padded"], found["shared_prompt"]
    assert len(padded) == len(shared) == 3
    np.testing.assert_allclose([s[0] for s in shared], [p[0] for p in padded], rtol=1e-5)
    np.testing.assert_allclose(shared_params, padded_params, atol=2e-6)
    computed = lambda runs: sum(counts[1] for _, counts in runs)  # noqa: E731
    assert computed(shared) < computed(padded)


@pytest.mark.parametrize(
    "loss, accumulation",
    # The accumulation case in `make test-slow` (~13 s): the default suite stays under 15 min.
    [("mse", 1), pytest.param("plackett_luce", 2, marks=pytest.mark.slow)],
)
def test_shared_prompt_groups_train_as_padded_groups(tokenizer, tmp_path, loss, accumulation):
    """data.layout=shared_prompt lays each group out as one prompt and K branches
    (`pack_group_records`): the same rows in the same order give the padded layout's losses and
    parameters, with fewer computed tokens; also as 2 microbatches of 2 groups
    (`packing.pack_microbatches`) against the padded 4 at once."""
    pairs = rows(TRAIN, 24)
    data = score_rows(pairs) if loss in losses.SCORE_LOSSES else ranked_rows(pairs)
    train_in_both_layouts(
        tokenizer, tmp_path, data, lambda: tiny_llama(tokenizer), accumulation, loss=loss
    )


# ------------------------------------------------------------------------------- evaluation


def reference_rewards(model, tokenizer, texts):
    """Independent reference: each text tokenized here (+EOS, as training does) and scored by
    `rewardax.scoring.RewardScorer` (its own padding and batching)."""
    from rewardax.scoring import RewardScorer

    scorer = RewardScorer(
        model, pad_id=tokenizer.eos_token_id, max_sequence_length=64, batch_size=64
    )
    return scorer([np.asarray([*tokenizer(t).input_ids, tokenizer.eos_token_id]) for t in texts])


def reference_plackett_luce(model, tokenizer, ranked):
    """Mean per-row Plackett-Luce loss of `reference_rewards` against each row's ranks."""
    from rewardax import ranking_losses

    texts = [row["prompt"] + x for row in ranked for x in row["responses"]]
    every = iter(reference_rewards(model, tokenizer, texts))
    per_row = [
        float(
            ranking_losses.plackett_luce_loss(
                np.asarray([[next(every) for _ in row["responses"]]], np.float32),
                np.asarray([row["ranks"]], np.float32),
                np.ones((1, len(row["ranks"])), np.float32),
            )[0]
        )
        for row in ranked
    ]
    return float(np.mean(per_row))


def saved_model_and_rows(tokenizer, tmp_path, data, name):
    """A tiny llama saved as a model directory, and ``data`` written to ``name``.jsonl."""
    model_dir = tmp_path / "model"
    model = tiny_llama(tokenizer, seed=5)
    model.save_pretrained(model_dir, tokenizer=tokenizer)
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return model, model_dir, path


def test_eval_metrics_equal_those_of_independent_rewards(tokenizer, tmp_path):
    pairs = rows(HELDOUT, 10)
    scores, ranked = score_rows(pairs), ranked_rows(pairs)
    model = tiny_llama(tokenizer, seed=3)
    trainer = rx.RewardTrainer(
        make_config(tmp_path, run_name="eval", loss="mse", bucket_lengths=[64]),
        tokenizer,
        model=model,
        eval_dataset={"scores": scores, "ranked": ranked},
    )
    metrics = trainer.evaluate()

    # Score rows: ρ, τ-b and MSE of each row's reward against its score.
    got = trainer._last_rewards["scores"]
    want = reference_rewards(model, tokenizer, [r["prompt"] + r["response"] for r in scores])
    np.testing.assert_allclose(got.rewards, want, atol=1e-5)
    target = np.array([r["score"] for r in scores])
    m = metrics["scores"]
    assert m["num_rows"] == len(scores) == 20
    assert m["spearman"] == pytest.approx(scipy.stats.spearmanr(got.rewards, target).statistic)
    assert m["kendall_tau"] == pytest.approx(scipy.stats.kendalltau(got.rewards, target).statistic)
    assert m["mse"] == pytest.approx(np.mean((got.rewards - target) ** 2), rel=1e-6)

    # Ranked rows: per-row ρ, τ and top-1 from each response's reward; accuracy over the
    # pairs the ranks imply.
    m = metrics["ranked"]
    rho, tau, top1, wins, count = [], [], [], 0.0, 0
    texts = [row["prompt"] + x for row in ranked for x in row["responses"]]
    every = iter(reference_rewards(model, tokenizer, texts))
    for row in ranked:
        r = np.asarray([next(every) for _ in row["responses"]])
        better = -np.asarray(row["ranks"], float)
        rho.append(scipy.stats.spearmanr(r, better).statistic)
        tau.append(scipy.stats.kendalltau(r, better).statistic)
        top1.append(float(better[np.argmax(r)] == better.max()))
        for a in range(len(r)):
            for b in range(len(r)):
                if better[a] > better[b]:
                    wins, count = wins + float(r[a] > r[b]), count + 1
    assert m["num_pairs"] == count
    assert m["accuracy"] == pytest.approx(wins / count)
    assert m["ranking"]["num_rows"] == len(ranked)
    assert m["ranking"]["spearman"] == pytest.approx(np.mean(rho), abs=1e-9)
    assert m["ranking"]["kendall_tau"] == pytest.approx(np.mean(tau), abs=1e-9)
    assert m["ranking"]["top1_accuracy"] == pytest.approx(np.mean(top1))


def test_eval_of_a_ranking_trained_model_reports_its_ranking_loss(tokenizer, tmp_path):
    """A model trained with a ranking loss is also judged by it on ranked eval rows: the
    ranking metrics' `loss` is the mean per-row Plackett-Luce loss of independent rewards."""
    ranked = ranked_rows(rows(HELDOUT, 6))
    model = tiny_llama(tokenizer, seed=3)
    config = make_config(tmp_path, run_name="pl", loss="plackett_luce", bucket_lengths=[64])
    trainer = rx.RewardTrainer(config, tokenizer, model=model, eval_dataset={"ranked": ranked})
    got = trainer.evaluate()["ranked"]["ranking"]
    assert got["num_rows"] == len(ranked)
    assert got["loss"] == pytest.approx(reference_plackett_luce(model, tokenizer, ranked), rel=1e-5)


def test_cli_eval_and_score_take_score_rows(tokenizer, tmp_path, capsys):
    data = score_rows(rows(HELDOUT, 6))
    model, model_dir, path = saved_model_and_rows(tokenizer, tmp_path, data, "scores")
    code, out, _ = run_main(capsys, ["score", "--model", str(model_dir), "--input", str(path),
                                     "--output", str(tmp_path / "scored.jsonl")])  # fmt: skip
    assert code == 0
    scored = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [r["score"] for r in scored] == [r["score"] for r in data]
    rewards = np.array([r["reward"] for r in scored])
    want = reference_rewards(model, tokenizer, [r["prompt"] + r["response"] for r in data])
    np.testing.assert_allclose(rewards, want, atol=1e-5)

    target = np.array([r["score"] for r in data])
    for extra, has_mse in (([], False), (["--train.loss=mse"], True)):
        code, out, err = run_main(
            capsys, ["eval", "--model", str(model_dir), "--data", str(path), *extra]
        )
        assert code == 0, err
        metrics = json.loads(out.strip().splitlines()[-1])["metrics"]
        assert metrics["num_rows"] == len(data)
        assert metrics["spearman"] == pytest.approx(
            scipy.stats.spearmanr(rewards, target).statistic
        )
        assert metrics["kendall_tau"] == pytest.approx(
            scipy.stats.kendalltau(rewards, target).statistic
        )
        assert ("mse" in metrics) == has_mse
        if has_mse:
            assert metrics["mse"] == pytest.approx(np.mean((rewards - target) ** 2), rel=1e-5)


def test_cli_eval_reports_the_ranking_loss_of_a_ranking_run(tokenizer, tmp_path, capsys):
    ranked = ranked_rows(rows(HELDOUT, 6))
    model, model_dir, path = saved_model_and_rows(tokenizer, tmp_path, ranked, "ranked")
    want = reference_plackett_luce(model, tokenizer, ranked)
    for extra, has_loss in (([], False), (["--train.loss=plackett_luce"], True)):
        code, out, err = run_main(
            capsys, ["eval", "--model", str(model_dir), "--data", str(path), *extra]
        )
        assert code == 0, err
        ranking = json.loads(out.strip().splitlines()[-1])["metrics"]["ranking"]
        assert ranking["num_rows"] == len(ranked)
        assert ("loss" in ranking) == has_loss
        if has_loss:
            assert ranking["loss"] == pytest.approx(want, rel=1e-5)


def test_rewardax_data_exports_the_padded_group_batch_keys():
    # Regression: a merge re-exported packing.GROUP_KEYS over groups.GROUP_KEYS, so the trainer
    # and the score-row scorer dropped attention_mask/reward_index from group batches (KeyError).
    import rewardax.data as rdata
    from rewardax.data import groups

    assert rdata.GROUP_KEYS == groups.GROUP_KEYS
    assert {"attention_mask", "reward_index"} <= set(rdata.GROUP_KEYS)
