"""Property-based fuzzing of the data pipeline with malformed rows (issue #8).

Every outcome must be a valid batch or a rewardax DataError naming the row: never a hang, never an
uncaught exception from numpy, the tokenizer or JAX. Over 1,000 generated rows per run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_fixtures import smollm2_tokenizer
from rewardax.data import DataConfig, create_tfds_collect_function, iterate_eval_batches
from rewardax.errors import DataError, RewardaxError

MAX_LEN = 48
FUZZ = settings(
    max_examples=600,
    deadline=None,
    derandomize=True,  # the same examples on every CI run: a failure is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
text = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=300, max_size=2000),  # huge
    st.just(""),
    st.just("\ud800 lone surrogate"),
)
role = st.sampled_from(["user", "assistant", "system", "tool", "robot", "", None, 3])
message = st.dictionaries(
    st.sampled_from(["role", "content", "from", "value", "name"]),
    st.one_of(role, text, junk),
    max_size=3,
)
messages = st.lists(message, max_size=4)
field_value = st.one_of(text, messages, junk, st.lists(st.integers(-5, 60000), max_size=20))
keys = st.sampled_from(
    [
        "prompt",
        "chosen",
        "rejected",
        "margin",
        "score_chosen",
        "score_rejected",
        "chosen_input_ids",
        "rejected_input_ids",
        "conversations",
        "tools",
        "chat_template_kwargs",
        "extra",
    ]
)
rows = st.one_of(
    st.dictionaries(keys, field_value, max_size=5),
    st.fixed_dictionaries({"chosen": field_value, "rejected": field_value}),
    st.fixed_dictionaries({"prompt": field_value, "chosen": text, "rejected": text}),
    st.fixed_dictionaries({"chosen": messages, "rejected": messages}),
    junk,
)


def assert_valid_batch(batch: dict, pad_id: int) -> None:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    b, two, t = ids.shape
    assert two == 2 and t <= MAX_LEN and mask.shape == ids.shape
    assert ids.dtype == np.int32 and mask.dtype == np.int32
    assert batch["reward_index"].shape == (b, 2) and batch["pair_mask"].shape == (b,)
    assert np.isfinite(batch["margin"]).all()
    for i in range(b):
        if batch["pair_mask"][i] == 0:
            continue
        for side in range(2):
            length = int(mask[i, side].sum())
            assert length >= 1
            assert (mask[i, side, :length] == 1).all()  # right padding, contiguous
            assert batch["reward_index"][i, side] == length - 1
            assert (ids[i, side, length:] == pad_id).all()


@FUZZ
@given(row=rows)
def test_fuzzed_rows_give_a_batch_or_a_data_error(tokenizer, row):
    strict = create_tfds_collect_function(
        tokenizer, MAX_LEN, "keep_end", data_config=DataConfig(max_sequence_length=MAX_LEN)
    )
    try:
        batch = strict([row])
    except DataError as error:
        assert "row" in str(error)  # the message names where the problem is
    else:
        assert_valid_batch(batch, tokenizer.pad_token_id)


@FUZZ
@given(batch_rows=st.lists(rows, min_size=1, max_size=4))
def test_fuzzed_rows_are_skipped_and_counted_under_skip(tokenizer, batch_rows):
    lenient = create_tfds_collect_function(
        tokenizer,
        MAX_LEN,
        "keep_end",
        data_config=DataConfig(max_sequence_length=MAX_LEN, on_invalid="skip"),
        batch_size=4,
    )
    batch = lenient(batch_rows)  # never raises: bad rows become padding pairs
    assert batch["input_ids"].shape[0] == 4
    assert_valid_batch(batch, tokenizer.pad_token_id)


line = st.one_of(
    rows.map(lambda r: json.dumps(r, default=str).encode("utf-8", "surrogatepass")),
    st.binary(max_size=40),  # invalid UTF-8 and arbitrary bytes
    rows.map(lambda r: json.dumps(r, default=str).encode("utf-8", "surrogatepass") + b" }garbage"),
    st.just(b""),
)


@settings(FUZZ, max_examples=120)
@given(lines=st.lists(line, min_size=1, max_size=6))
def test_fuzzed_jsonl_files(tokenizer, tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fuzz") / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    config = DataConfig(max_sequence_length=MAX_LEN)
    try:
        for batch in iterate_eval_batches(str(path), tokenizer, config, batch_size=4):
            assert_valid_batch(batch, tokenizer.pad_token_id)
    except RewardaxError as error:
        assert "rows.jsonl" in str(error)  # names the file
