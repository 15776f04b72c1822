"""Formats, golden token ids, length policy, margins, the two collate functions, bad input."""

import copy
import itertools

import numpy as np
import pytest

from data_fixtures import smollm2_tokenizer
from rewardax.data import (
    DataConfig,
    collate_records,
    create_grain_collect_function,
    create_tfds_collect_function,
    default_bucket_lengths,
)
from rewardax.errors import DataError

IM_START, IM_END = 1, 2
# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
SYSTEM = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
]
USER_HI = [1, 4093, 198, 26843, 2, 198]  # "<|im_start|>user\nHi<|im_end|>\n"
ASSISTANT = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"
CONV_CHOSEN = SYSTEM + USER_HI + ASSISTANT + [19556, 17, IM_END]  # "Hello!<|im_end|>"
CONV_REJECTED = SYSTEM + USER_HI + ASSISTANT + [6044, 2025, 30, IM_END]  # "Go away.<|im_end|>"
REVIEW_GREAT = [21465, 42, 3756, 4771, 30, IM_END]  # "Review: Great film.<|im_end|>"
REVIEW_DULL = [21465, 42, 422, 1274, 4771, 30, IM_END]  # "Review: Dull film.<|im_end|>"

GOLDEN = {
    "standard_implicit": (
        {"chosen": "The film was great.", "rejected": "The film was dull."},
        [504, 4771, 436, 1109, 30, IM_END],
        [504, 4771, 436, 19724, 30, IM_END],
    ),
    "standard_explicit": (
        {"prompt": "Review: ", "chosen": "Great film.", "rejected": "Dull film."},
        REVIEW_GREAT,
        REVIEW_DULL,
    ),
    "standard_explicit_not_doubled": (
        {"prompt": "Review: ", "chosen": "Review: Great film.", "rejected": "Dull film."},
        REVIEW_GREAT,
        REVIEW_DULL,
    ),
    "conversational_explicit": (
        {
            "prompt": [{"role": "user", "content": "Hi"}],
            "chosen": [{"role": "assistant", "content": "Hello!"}],
            "rejected": [{"role": "assistant", "content": "Go away."}],
        },
        CONV_CHOSEN,
        CONV_REJECTED,
    ),
    "conversational_implicit": (
        {
            "chosen": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
            ],
            "rejected": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Go away."},
            ],
        },
        CONV_CHOSEN,
        CONV_REJECTED,
    ),
    "sharegpt": (
        {
            "conversations": [{"from": "human", "value": "Hi"}],
            "chosen": {"from": "gpt", "value": "Hello!"},
            "rejected": {"from": "gpt", "value": "Go away."},
        },
        CONV_CHOSEN,
        CONV_REJECTED,
    ),
    "pretokenized": (
        {"chosen_input_ids": [5, 6, 7], "rejected_input_ids": [5, 6, 8]},
        [5, 6, 7],
        [5, 6, 8],
    ),
}


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def other_template(tok, template):
    # A copy with another chat template (building a second GGUF tokenizer takes seconds).
    clone = copy.deepcopy(tok)
    clone.chat_template = template
    return clone


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_token_ids(tok, name):
    row, chosen, rejected = GOLDEN[name]
    record = create_grain_collect_function(tok, 64)(row)
    assert record["chosen_input_ids"].tolist() == chosen
    assert record["rejected_input_ids"].tolist() == rejected
    assert record["chosen_input_ids"].dtype == np.int32


def test_chat_has_one_bos_and_tools_reach_template(tok):
    row = dict(GOLDEN["conversational_explicit"][0])
    ids = create_grain_collect_function(tok, 64)(row)["chosen_input_ids"].tolist()
    assert ids.count(IM_START) == 3 and ids[0] == IM_START and ids[1] != IM_START
    tok2 = other_template(
        tok,
        "{{ bos_token }}{% if tools %}T{{ tools|length }}{% endif %}{% if loud %}!{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}",
    )
    row = {**row, "tools": [{"name": "a"}, {"name": "b"}], "chat_template_kwargs": {"loud": True}}
    ids = create_grain_collect_function(tok2, 64)(row)["chosen_input_ids"].tolist()
    assert tok2.decode(ids) == "<|im_start|>T2!HiHello!<|im_end|>"
    assert ids.count(IM_START) == 1


def test_eos_appended_only_when_missing_and_configurable(tok):
    fn = create_grain_collect_function(tok, 64)
    rec = fn({"chosen": "Good.<|im_end|>", "rejected": "Bad."})
    assert (
        rec["chosen_input_ids"].tolist().count(IM_END) == 1
        and rec["rejected_input_ids"][-1] == IM_END
    )
    off = create_grain_collect_function(tok, 64, data_config=DataConfig(append_eos=False))
    assert off({"chosen": "Good.", "rejected": "Bad."})["chosen_input_ids"][-1] != IM_END


LONG = {"prompt": "word " * 40, "chosen": "Yes indeed.", "rejected": "No."}


def test_keep_end_cuts_prompt_from_left_and_keeps_reward_token(tok):
    full = create_grain_collect_function(tok, 512)(LONG)
    cut = create_grain_collect_function(tok, 16, "keep_end")(LONG)
    for key in ("chosen_input_ids", "rejected_input_ids"):
        assert len(cut[key]) <= 16
        assert cut[key][-1] == IM_END  # the reward token survives
    # The whole response survives: the chosen tail equals the untruncated tail.
    assert tok.decode(cut["chosen_input_ids"]).endswith(" word Yes indeed.<|im_end|>")
    assert cut["chosen_input_ids"].tolist() == full["chosen_input_ids"].tolist()[-16:]
    assert cut["truncated"] and not full["truncated"]


def test_keep_start_scores_last_kept_token_and_filter_drops(tok):
    rec = create_grain_collect_function(tok, 10, "keep_start")(
        {"chosen": "a b c d e f g h i j k l m", "rejected": "x"}
    )
    assert len(rec["chosen_input_ids"]) == 10
    batch = collate_records([rec], 2, (10,))
    assert batch["reward_index"].tolist() == [[9, 1]]
    cfg = DataConfig(on_invalid="skip")
    assert (
        create_grain_collect_function(tok, 10, "filter", data_config=cfg)(
            {"chosen": "a b c d e f g h i j k l", "rejected": "x"}
        )
        is None
    )


def test_margin_reaches_batch(tok):
    rows = [
        {"chosen": "Good.", "rejected": "Bad.", "margin": 2.5},
        {"chosen": "Fine.", "rejected": "Poor."},
    ]
    batch = create_tfds_collect_function(tok, 64)(rows)
    np.testing.assert_allclose(batch["margin"], [2.5, 0.0])
    scored = [{"chosen": "Good.", "rejected": "Bad.", "score_chosen": 8.0, "score_rejected": 3.0}]
    cfg = DataConfig(margin_from_scores=True, margin_scale=0.5)
    batch = create_tfds_collect_function(tok, 64, data_config=cfg)(scored)
    np.testing.assert_allclose(batch["margin"], [2.5])


def test_both_collate_functions_give_identical_batches(tok):
    rows = [GOLDEN[name][0] for name in ("standard_implicit", "standard_explicit", "sharegpt")]
    rows = [{**r, "margin": float(i)} for i, r in enumerate(rows)]
    grain_fn = create_grain_collect_function(tok, 128)
    via_grain = collate_records([grain_fn(r) for r in rows], 2, default_bucket_lengths(128), 4)
    via_tfds = create_tfds_collect_function(tok, 128, batch_size=4)(rows)
    assert sorted(via_grain) == sorted(via_tfds)
    for key, value in via_grain.items():
        np.testing.assert_array_equal(value, via_tfds[key])
    # The batch itself: shapes, dtypes, masks, reward index at the last real token, padding pair.
    # The longest sequence (the ShareGPT chat, 34 tokens) rounds up to the 40 rung of the ladder.
    assert via_tfds["input_ids"].shape == (4, 2, 40) and via_tfds["input_ids"].dtype == np.int32
    assert via_tfds["pair_mask"].tolist() == [1, 1, 1, 0]
    lengths = via_tfds["attention_mask"].sum(-1)
    np.testing.assert_array_equal(via_tfds["reward_index"][:3], lengths[:3] - 1)
    assert via_tfds["reward_index"][3].tolist() == [0, 0] and lengths[3].tolist() == [0, 0]
    assert via_tfds["input_ids"][0, 0, 6:].tolist() == [2] * 34  # right-padded with the pad id


def test_buckets():
    # The ladder: 4 equal steps per doubling (those of 32..64 below 32); the max always ends it.
    assert default_bucket_lengths(512) == (
        (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
    )
    assert default_bucket_lengths(300)[-3:] == (224, 256, 300)
    assert default_bucket_lengths(512, buckets_per_octave=1) == (32, 64, 128, 256, 512)
    fine = default_bucket_lengths(256, buckets_per_octave=8)
    assert fine[:9] == (4, 8, 12, 16, 20, 24, 28, 32, 36) and fine[-5:] == (192, 208, 224, 240, 256)
    assert default_bucket_lengths(512, (100, 900)) == (100, 512)
    # From 1024 tokens on, twice the steps: long rows' padding costs seconds a step.
    assert default_bucket_lengths(2048)[-10:] == (
        (896, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048)
    )
    assert default_bucket_lengths(2048, buckets_per_octave=1)[-3:] == (1024, 1536, 2048)
    # More steps than tokens in an octave: one-token steps there (this used to loop forever).
    assert default_bucket_lengths(128, buckets_per_octave=64)[:3] == (1, 2, 3)
    # Any rung wastes at most 1/(1 + buckets_per_octave) of a batch padded up to it.
    for per_octave in (1, 2, 4, 8):
        ladder = default_bucket_lengths(4096, buckets_per_octave=per_octave)
        gaps = [(b - a) / b for a, b in itertools.pairwise(ladder) if a >= 32]
        assert max(gaps) <= 1 / (1 + per_octave) + 1e-9


BAD = [
    ({"rejected": "x"}, "missing_field", "'chosen'"),
    ({"chosen": None, "rejected": "x"}, "missing_field", "'chosen'"),
    ({"chosen": "   ", "rejected": "x"}, "empty_field", "'chosen'"),
    ({"chosen": 3, "rejected": "x"}, "wrong_type", "'chosen'"),
    ({"chosen": "same", "rejected": "same"}, "identical", "identical"),
    (
        {"chosen": [{"content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
        "bad_message",
        "chosen[0]",
    ),
    (
        {
            "chosen": [{"role": "robot", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}],
        },
        "unknown_role",
        "robot",
    ),
    (
        {"chosen": [{"from": "alien", "value": "a"}], "rejected": [{"from": "gpt", "value": "b"}]},
        "unknown_role",
        "alien",
    ),
    ({"chosen": "a", "rejected": "b", "margin": "big"}, "bad_margin", "'margin'"),
    (
        {"chosen_input_ids": [1, 10**9], "rejected_input_ids": [1, 2]},
        "bad_token_id",
        "chosen_input_ids",
    ),
]


@pytest.mark.parametrize(("row", "reason", "needle"), BAD)
def test_bad_input_errors_name_field_and_skip_counts(tok, row, reason, needle):
    with pytest.raises(DataError, match="row 0") as info:
        create_tfds_collect_function(tok, 16)([row])
    assert needle in str(info.value) and "on_invalid=skip" in str(info.value)
    from rewardax.data.collate import RowProcessor

    record = RowProcessor(tok, DataConfig(max_sequence_length=16, on_invalid="skip")).process(
        row, 0, "row 0"
    )
    assert record["dropped"] == reason


def test_keep_end_keeps_the_end_of_a_response_longer_than_the_limit(tok):
    """keep_end never refuses a long response: its last tokens (with the reward token) stay."""
    from rewardax.data.collate import RowProcessor

    row = {"prompt": "p ", "chosen": "word " * 30, "rejected": "x"}
    full = RowProcessor(tok, DataConfig(max_sequence_length=512)).process(row, 0, "row 0")
    cut = RowProcessor(tok, DataConfig(max_sequence_length=16)).process(row, 0, "row 0")
    full_ids, cut_ids = full["chosen_input_ids"].tolist(), cut["chosen_input_ids"].tolist()
    assert len(full_ids) > 16 and len(cut_ids) == 16
    keep_bos = 1 if tok.bos_token_id is not None and full_ids[0] == tok.bos_token_id else 0
    assert cut_ids == full_ids[:keep_bos] + full_ids[len(full_ids) - (16 - keep_bos) :]
    assert cut_ids[-1] == full_ids[-1]  # the reward token
    assert cut["truncated"] and not full["truncated"]


def test_chat_template_failure_is_a_data_error(tok):
    tok2 = other_template(
        tok,
        "{{ raise_exception('no tools here') if tools else '' }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    row = {**GOLDEN["conversational_implicit"][0], "tools": [{"name": "a"}]}
    with pytest.raises(DataError, match="chat template failed"):
        create_tfds_collect_function(tok2, 64)([row])


def test_chunked_encoding_equals_row_by_row(tok):
    from rewardax.data.collate import RowProcessor

    rows = [GOLDEN[name][0] for name in ("standard_implicit", "standard_explicit")] * 3 + [
        {"prompt": "word " * 40, "chosen": "Yes indeed.", "rejected": "No."},  # keep_end cuts
        {"chosen": "same", "rejected": "same"},  # invalid
        {"prompt": "Q: ", "chosen": "A café, naïve résumé 東京 🙂.", "rejected": "Nope\n\n"},
    ]
    processor = RowProcessor(tok, DataConfig(max_sequence_length=32, on_invalid="skip"), "standard")
    together = processor.process_many(rows, list(range(len(rows))), lambda i: f"row {i}")
    for i, (row, record) in enumerate(zip(rows, together, strict=True)):
        alone = processor.process(row, i, f"row {i}")
        assert sorted(alone) == sorted(record)
        for key, value in alone.items():
            assert np.array_equal(value, record[key]), (i, key)
    # The ids are the tokenizer's own, one text at a time (plus EOS).
    last = together[-1]["chosen_input_ids"].tolist()
    assert last == [*tok("Q: A café, naïve résumé 東京 🙂.").input_ids, IM_END]
    assert together[6]["truncated"] and together[7]["dropped"] == "identical"


def test_every_bundled_row_fits_the_tiny_config(tok):
    """configs/tiny.yaml (32 tokens) on the bundled VADER files: every pair is kept, long ones cut."""
    import json
    from importlib import resources

    from rewardax.config import RewardConfig
    from rewardax.data.collate import RowProcessor

    config = RewardConfig.from_yaml(resources.files("rewardax") / "configs" / "tiny.yaml")
    processor = RowProcessor(tok, config.data)
    cut = 0
    for name in ("train", "train_extra", "heldout"):
        lines = (
            resources.files("rewardax") / "assets" / f"vader_movie_pairs.{name}.jsonl"
        ).read_text()
        for i, line in enumerate(lines.splitlines()):
            record = processor.process(json.loads(line), i, f"{name} row {i}")
            assert "dropped" not in record, record
            assert len(record["chosen_input_ids"]) <= 32 >= len(record["rejected_input_ids"])
            cut += record["truncated"]
    assert cut > 0  # the limit does bite: some rows are longer than 32 tokens
