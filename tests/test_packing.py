"""Packed and shared-prompt layouts: same rewards, loss and update as the padded layout, on real
SmolLM2-tokenized VADER pairs and a tiny random model."""

from __future__ import annotations

import json
from importlib import resources

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import rewardax as rx
from data_fixtures import smollm2_tokenizer
from rewardax.data import (
    DataConfig,
    PreferenceLoader,
    collate_records,
    common_prefix_length,
    default_bucket_lengths,
    pack_records,
    packing_row_lengths,
)
from rewardax.data.collate import RowProcessor
from rewardax.data.packing import (
    LONG_ROW_TIES,
    choose_shape,
    pack_groups,
    pack_microbatches,
    row_ladder,
    token_counts,
)
from rewardax.errors import ConfigError
from rewardax.state import RewardState
from rewardax.steps import make_eval_step, make_train_step

TRAIN = str(resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl")
MAX_LEN = 128


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def records(tokenizer):
    with open(TRAIN, encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(24), f, strict=False)]
    processor = RowProcessor(tokenizer, DataConfig(max_sequence_length=MAX_LEN))
    out = processor.process_many(rows, range(len(rows)), lambda i: f"row {i}")
    for i, record in enumerate(out):
        record["margin"] = 0.25 * (i % 5) - 0.5  # distinct margins: they must reach their pair
    return out


def tiny_state(tokenizer, seed=0):
    config = rx.ModelConfig(
        architecture="llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return RewardState.create(rx.RewardModel(config, rngs=nnx.Rngs(seed)), optax.sgd(0.5))


def layouts(records, pad_id, batch_size):
    padded = collate_records(records, pad_id, default_bucket_lengths(MAX_LEN), batch_size)
    out = {"padded": padded}
    for layout in ("packed", "shared_prompt"):
        config = DataConfig(max_sequence_length=MAX_LEN, layout=layout)
        out[layout] = pack_records(
            records,
            pad_id,
            layout=layout,
            batch_size=batch_size,
            row_lengths=packing_row_lengths(config),
        )
    # Rows longer than any one sequence (data.bucket_lengths above max_row_length): each row
    # then holds several pairs under one prompt-and-branches tree apiece.
    config = DataConfig(
        max_sequence_length=MAX_LEN, layout="shared_prompt", bucket_lengths=(3 * MAX_LEN,)
    )
    out["shared_prompt_long_rows"] = pack_records(
        records,
        pad_id,
        layout="shared_prompt",
        batch_size=batch_size,
        row_lengths=packing_row_lengths(config),
    )
    return out


def test_rows_longer_than_a_sequence_only_when_packed():
    """Given lengths above the longest row stay for packed layouts (max_row_length is added only
    when none reaches it) and are dropped for padded ones."""
    shared = DataConfig(max_sequence_length=64, layout="shared_prompt", bucket_lengths=(192,))
    assert packing_row_lengths(shared) == (192,)
    shared.bucket_lengths = (96,)
    assert packing_row_lengths(shared) == (96, 128)
    packed = DataConfig(max_sequence_length=64, layout="packed", bucket_lengths=(48, 160))
    assert packing_row_lengths(packed) == (48, 160)
    assert default_bucket_lengths(64, (48, 160)) == (48, 64)


def test_token_ties_go_to_longer_rows_up_to_the_limit():
    # Items of 120, 120, 120, 120, 60, 60 tokens: 6 x 128 (the 60s share a row; 5 rows, the
    # ladder's next is 6) and 4 x 192 (a 60 beside two of the 120s) both compute 768 tokens, and
    # 3 x 192 cannot hold four 120s. The longer rows win the tie; past LONG_ROW_TIES the shorter
    # rows do (attention's T^2 cost per row then counts).
    rows = row_ladder(16)
    r, t, placed = choose_shape([120, 120, 120, 120, 60, 60], (128, 192), rows)
    assert (r, t) == (4, 192)
    assert sorted(np.bincount(placed).tolist()) == [1, 1, 2, 2]
    # Five k-token items, k > LONG_ROW_TIES / 2: 3 rows of 2k or 2 rows of 3k, 6k tokens each.
    k = LONG_ROW_TIES // 2 + 44
    assert choose_shape([k] * 5, (2 * k, 3 * k), rows)[:2] == (3, 2 * k)
    # Fewer tokens still beat longer rows: 4 x 128 (512) over 3 x 192 (576).
    assert choose_shape([100] * 4, (128, 192), rows)[:2] == (4, 128)


def unpack(batch: dict, pair: int) -> list[tuple[list[int], list[int]]]:
    """(token ids, positions) of a pair's chosen and rejected sequence, read back from a packed
    batch through its reward slots, segments and branches."""
    k = batch["reward_positions"].shape[1]
    out = []
    for side in (0, 1):
        row, slot = divmod(int(batch["reward_slot"][pair, side]), k)
        end = int(batch["reward_positions"][row, slot])
        seg = batch["segment_ids"][row] == batch["segment_ids"][row, end]
        if "branch_ids" in batch:
            branch = batch["branch_ids"][row]
            seg &= (branch == 0) | (branch == branch[end])
        take = np.flatnonzero(seg & (np.arange(seg.size) <= end))
        assert take[-1] == end  # the reward is read at the sequence's last token
        out.append((batch["input_ids"][row, take].tolist(), batch["positions"][row, take].tolist()))
    return out


@pytest.mark.parametrize("layout", ["packed", "shared_prompt", "shared_prompt_long_rows"])
def test_every_pair_exactly_once_with_its_margin(records, tokenizer, layout):
    batch = layouts(records[:10], tokenizer.pad_token_id, 12)[layout]
    shared_prompt = layout.startswith("shared_prompt")
    real_tokens = 0
    for p, record in enumerate(records[:10]):
        (c_ids, c_pos), (r_ids, r_pos) = unpack(batch, p)
        assert c_ids == record["chosen_input_ids"].tolist()
        assert r_ids == record["rejected_input_ids"].tolist()
        assert c_pos == list(range(len(c_ids))) and r_pos == list(range(len(r_ids)))
        shared = common_prefix_length(record["chosen_input_ids"], record["rejected_input_ids"])
        real_tokens += len(c_ids) + len(r_ids) - (shared if shared_prompt else 0)
        assert batch["margin"][p] == np.float32(record["margin"])
    # Nothing else sits in the rows: every non-padding token belongs to exactly one pair.
    assert np.count_nonzero(batch["segment_ids"]) == real_tokens
    slots = batch["reward_slot"][:10].ravel()
    assert len(set(slots.tolist())) == 20  # no reward slot is read by two sequences
    np.testing.assert_array_equal(batch["pair_mask"], [1.0] * 10 + [0.0] * 2)
    if shared_prompt:
        # VADER rows share the instruction: the prompt branch is really used.
        assert np.count_nonzero((batch["branch_ids"] == 0) & (batch["segment_ids"] > 0)) > 50


def test_common_prefix_keeps_a_token_per_response():
    a, b = np.array([1, 2, 3, 4]), np.array([1, 2, 5])
    assert common_prefix_length(a, b) == 2
    assert common_prefix_length(np.array([1, 2]), np.array([1, 2, 3])) == 1  # a prefix of b
    assert common_prefix_length(np.array([7]), np.array([7, 8])) == 0
    assert row_ladder(20) == (1, 2, 3, 4, 6, 8, 12, 16, 24)
    assert row_ladder(9, multiple=4) == (4, 8, 12)


@pytest.mark.slow
def test_rewards_loss_and_update_equal_padded(records, tokenizer):
    state = tiny_state(tokenizer)
    batches = layouts(records[:14], tokenizer.pad_token_id, 16)  # 2 padding pairs
    eval_step = jax.jit(make_eval_step(state.graphdef))
    train_step = jax.jit(
        make_train_step(state.graphdef, optax.sgd(0.5), optax.constant_schedule(0.5))
    )
    ref = jax.device_get(eval_step(state.arrays(), batches["padded"]))
    ref_arrays, ref_metrics = jax.device_get(train_step(state.arrays(), batches["padded"]))
    before = [np.asarray(x) for x in jax.tree.leaves(state.arrays()["params"])]
    moved = max(
        np.abs(np.asarray(a) - b).max()
        for a, b in zip(jax.tree.leaves(ref_arrays["params"]), before, strict=True)
    )
    assert moved > 1e-3  # the step really changed the parameters
    assert float(ref_metrics["num_pairs"]) == 14.0
    long_rows = batches["shared_prompt_long_rows"]
    assert long_rows["input_ids"].shape[1] == 3 * MAX_LEN
    assert long_rows["segment_ids"].max() > 1  # a row holds more than one pair
    for layout in ("packed", "shared_prompt", "shared_prompt_long_rows"):
        got = jax.device_get(eval_step(state.arrays(), batches[layout]))
        for side in ("chosen", "rejected"):
            np.testing.assert_allclose(got[side][:14], ref[side][:14], atol=1e-5, rtol=0)
        arrays, metrics = jax.device_get(train_step(state.arrays(), batches[layout]))
        for key in ("loss", "accuracy", "margin", "reward_std", "grad_norm", "num_pairs"):
            np.testing.assert_allclose(metrics[key], ref_metrics[key], atol=1e-5, rtol=1e-5)
        for a, b in zip(
            jax.tree.leaves(arrays["params"]), jax.tree.leaves(ref_arrays["params"]), strict=True
        ):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_padding_pairs_contribute_nothing(records, tokenizer):
    state = tiny_state(tokenizer)
    train_step = jax.jit(
        make_train_step(state.graphdef, optax.sgd(0.5), optax.constant_schedule(0.5))
    )
    batch = layouts(records[:6], tokenizer.pad_token_id, 8)["packed"]
    _, ref = jax.device_get(train_step(state.arrays(), batch))
    poisoned = dict(batch, reward_slot=batch["reward_slot"].copy(), margin=batch["margin"].copy())
    poisoned["reward_slot"][6:] = batch["reward_slot"][0, ::-1]  # a wrong-way real pair
    poisoned["margin"][6:] = 100.0
    _, got = jax.device_get(train_step(state.arrays(), poisoned))
    for key in ("loss", "grad_norm", "accuracy", "num_pairs"):
        assert float(got[key]) == float(ref[key])
    # Control: the same change on a real pair does change the loss.
    poisoned["pair_mask"][6] = 1.0
    _, leaky = jax.device_get(train_step(state.arrays(), poisoned))
    assert abs(float(leaky["loss"]) - float(ref["loss"])) > 1.0


def test_microbatches_of_a_partial_group_batch():
    """3 groups of an 8-group batch in 4 microbatches: the last microbatch has no group (no
    `ranks` of its own), the others one each; every group keeps its ranks and its rewards' slots
    point at its responses' last tokens within its microbatch."""
    rng = np.random.default_rng(0)
    groups = [
        {
            "responses_input_ids": [rng.integers(3, 50, size=n).tolist() for n in sizes],
            "ranks": list(range(len(sizes))),
        }
        for sizes in ([5, 7, 6], [4, 4], [9, 3, 5])
    ]

    def pack(part, row_lengths):
        return pack_groups(part, 0, group_size=3, batch_size=2, row_lengths=row_lengths)

    batch = pack_microbatches(pack, groups, 4, (8, 16, 32), 0)
    np.testing.assert_array_equal(batch["row_mask"], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["ranks"][:3, :2], [[0, 1], [0, 1], [0, 1]])
    assert batch["ranks"][3:].sum() == 0 and batch["ranks"].shape == (8, 3)
    rows = batch["input_ids"].shape[0] // 4
    for g, group in enumerate(groups):
        m = g % 4  # microbatch m holds groups m, m + 4, ...
        mine = batch["input_ids"][m::4]  # its rows
        slots = batch["reward_positions"][m::4].reshape(-1)
        for k, seq in enumerate(group["responses_input_ids"]):
            row, _ = divmod(int(batch["reward_slot"][g, k]), batch["reward_positions"].shape[1])
            assert row < rows
            assert mine[row, slots[batch["reward_slot"][g, k]]] == seq[-1]


def test_accumulation_needs_a_batch_packed_as_microbatches(records, tokenizer):
    state = tiny_state(tokenizer)
    step = make_train_step(
        state.graphdef, optax.sgd(0.1), optax.constant_schedule(0.1), accumulation_steps=2
    )
    batch = layouts(records[:4], tokenizer.pad_token_id, 4)["packed"]
    with pytest.raises(ConfigError, match="packed as that many microbatches"):
        jax.jit(step)(state.arrays(), batch)


@pytest.mark.parametrize("layout, steps", [("packed", 3), ("shared_prompt", 2)])
def test_microbatch_packing_accumulates_the_whole_batch_update(records, tokenizer, layout, steps):
    """`pack_microbatches`: 11 real pairs of a 12-pair batch as `steps` microbatches, each packed
    on its own in one (R, T), interleaved; the step accumulating over them gives the update and
    metrics of the same pairs packed whole, in one step."""
    pad = tokenizer.pad_token_id
    lengths = packing_row_lengths(DataConfig(max_sequence_length=MAX_LEN, layout=layout))

    def pack(part, row_lengths, batch_size=12 // steps):
        return pack_records(
            part, pad, layout=layout, batch_size=batch_size, row_lengths=row_lengths
        )

    micro = pack_microbatches(pack, records[:11], steps, lengths, pad)
    whole = pack(records[:11], lengths, batch_size=12)
    assert micro["reward_positions"].shape[1] * steps == micro["reward_slot"].size == 24
    assert micro["input_ids"].shape[0] % steps == 0
    np.testing.assert_array_equal(micro["pair_mask"], [1.0] * 11 + [0.0])
    # Pair j of microbatch m is batch pair j * steps + m: the margins land in the batch's order
    # (records[m::steps] per microbatch, interleaved back).
    np.testing.assert_array_equal(micro["margin"][:11], [r["margin"] for r in records[:11]])

    def run(batch, accumulation):
        state = tiny_state(tokenizer)
        step = make_train_step(
            state.graphdef,
            optax.sgd(0.5),
            optax.constant_schedule(0.5),
            accumulation_steps=accumulation,
        )
        arrays, metrics = jax.device_get(jax.jit(step)(state.arrays(), batch))
        return jax.tree.leaves(arrays["params"]), metrics

    got, got_metrics = run(micro, steps)
    want, want_metrics = run(whole, 1)
    start = jax.tree.leaves(tiny_state(tokenizer).arrays()["params"])
    assert max(float(np.abs(a - b).max()) for a, b in zip(want, start, strict=True)) > 1e-3
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)
    for key in ("loss", "accuracy", "num_pairs", "grad_norm"):
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=1e-5)
    assert float(got_metrics["num_pairs"]) == 11


def test_packed_layouts_compute_no_more_tokens_than_padded_on_the_same_pairs(tokenizer):
    """All VADER pairs, 8 at a time, each group laid out padded, packed and shared_prompt.

    By construction a packed layout never computes more tokens than the padded one on the same
    pairs: the padded shape (one sequence per row, 2B rows of the smallest bucket T holding the
    longest) is among the shapes the packer weighs, since T is one of its row lengths and 2B one of
    its row counts, and it keeps the shape with the fewest tokens. For shared_prompt a pair (its
    prompt once, then both responses) is at most 2T long and 2T is one of its row lengths, so B
    rows of 2T also hold the batch. Both layouts hold every real token once (a shared prompt once
    per pair); the loader's batches keep to the allowed shapes and see every pair."""
    batch_size = 8
    with open(TRAIN, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    processor = RowProcessor(tokenizer, DataConfig(max_sequence_length=MAX_LEN))
    records = processor.process_many(rows, range(len(rows)), lambda i: f"row {i}")
    assert all("dropped" not in r for r in records)
    pad = tokenizer.pad_token_id
    buckets = default_bucket_lengths(MAX_LEN)
    lengths = {
        layout: packing_row_lengths(DataConfig(max_sequence_length=MAX_LEN, layout=layout))
        for layout in ("packed", "shared_prompt")
    }
    assert set(buckets) <= set(lengths["packed"])  # the premises of the bound above
    assert {2 * t for t in buckets} <= set(lengths["shared_prompt"])
    assert row_ladder(2 * batch_size)[-1] == 2 * batch_size
    assert row_ladder(batch_size)[-1] == batch_size
    totals = {layout: [0, 0] for layout in ("padded", "packed", "shared_prompt")}
    for start in range(0, len(records), batch_size):
        group = records[start : start + batch_size]
        real, computed = token_counts(collate_records(group, pad, buckets, batch_size))
        prompts = sum(
            common_prefix_length(r["chosen_input_ids"], r["rejected_input_ids"]) for r in group
        )
        totals["padded"][0] += real
        totals["padded"][1] += computed
        for layout, expected_real in (("packed", real), ("shared_prompt", real - prompts)):
            batch = pack_records(
                group, pad, layout=layout, batch_size=batch_size, row_lengths=lengths[layout]
            )
            got_real, got_computed = token_counts(batch)
            assert got_real == expected_real, (start, layout)
            assert got_computed <= computed, (start, layout, got_computed, computed)
            totals[layout][0] += got_real
            totals[layout][1] += got_computed
    efficiency = {layout: real / computed for layout, (real, computed) in totals.items()}
    print(efficiency)
    assert efficiency["packed"] > efficiency["padded"]

    # The loader's own batches: shapes from the allowed sets, every pair once.
    seen = {}
    for layout in ("padded", "packed", "shared_prompt"):
        config = DataConfig(max_sequence_length=MAX_LEN, layout=layout, prefetch=0)
        loader = PreferenceLoader(
            TRAIN, tokenizer, config, batch_size=batch_size, seed=0, num_epochs=1
        )
        for batch in loader:
            if layout == "padded":
                assert batch["input_ids"].shape[-1] in buckets
            else:
                r, t = batch["input_ids"].shape
                assert t in lengths[layout] and r in row_ladder(2 * batch_size)
        seen[layout] = loader.stats.pairs_seen
    assert seen["packed"] == seen["shared_prompt"] == seen["padded"] == len(records)


def train_tiny(tokenizer, directory, layout, accumulation=1):
    with open(TRAIN, encoding="utf-8") as f:
        data = [json.loads(line) for _, line in zip(range(16), f, strict=False)]
    config = rx.RewardConfig(
        per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        max_sequence_length=64,
        max_training_steps=2,
        save_directory=str(directory),
        run_name=layout,
        logging_steps=1,
        progress_bar=False,
        save_steps=100,
        layout=layout,
        length_group_window=1,  # packed layouts do not group by length: same batches
    )
    trainer = rx.RewardTrainer(
        config, tokenizer, model=tiny_state(tokenizer).model, train_dataset=data
    )
    return trainer, trainer.train()


@pytest.fixture(scope="module")
def padded_run(tokenizer, tmp_path_factory):
    return train_tiny(tokenizer, tmp_path_factory.mktemp("padded"), "padded")


@pytest.mark.parametrize("layout", ["packed", "shared_prompt"])
def test_trainer_end_to_end_matches_padded(tokenizer, tmp_path, padded_run, layout):
    ref_trainer, ref = padded_run
    trainer, result = train_tiny(tokenizer, tmp_path, layout)
    assert result.export_dir is not None and (result.export_dir / "config.json").exists()
    got, want = result.metrics["train"], ref.metrics["train"]
    assert got["padding_efficiency"] > want["padding_efficiency"]
    np.testing.assert_allclose(got["loss"], want["loss"], atol=1e-5)
    for a, b in zip(
        jax.tree.leaves(trainer.state.params),
        jax.tree.leaves(ref_trainer.state.params),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)


def test_trainer_accumulates_packed_microbatches_as_padded_does_one_batch(
    tokenizer, tmp_path, padded_run
):
    """shared_prompt, 2 pairs a device x 2 accumulation steps: the padded run's 4 pairs a step
    (the same pairs: the loader draws 4 a step either way), same losses and parameters."""
    ref_trainer, ref = padded_run
    trainer, result = train_tiny(tokenizer, tmp_path, "shared_prompt", accumulation=2)
    np.testing.assert_allclose(
        result.metrics["train"]["loss"], ref.metrics["train"]["loss"], atol=1e-5
    )
    for a, b in zip(
        jax.tree.leaves(trainer.state.params),
        jax.tree.leaves(ref_trainer.state.params),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
