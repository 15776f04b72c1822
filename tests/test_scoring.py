"""Scoring single responses: same tokens as training, batching invariance, streaming files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax.data import DataConfig, PairEncoder, normalize_row
from rewardax.data.formats import InvalidRow
from rewardax.data.tokenize import FilteredPair
from rewardax.errors import DataError, ModelLoadError
from rewardax.scoring import (
    ResponseEncoder,
    RewardScorer,
    normalization_of,
    score_file,
)

PROMPT = "Write one sentence about a film you saw.\n"


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer, seed=3)


def training_ids(tokenizer, row, config):
    """The chosen sequence a training pair gets (PairEncoder, the training path)."""
    fmt = "conversational" if isinstance(row["chosen"], list) else "standard"
    encoder = PairEncoder(tokenizer, config.max_sequence_length, config.truncation_mode)
    return encoder.encode(normalize_row(row, fmt))["chosen_input_ids"].tolist()


@pytest.mark.parametrize("max_len", [512, 18])
def test_text_rows_tokenize_as_the_chosen_side_of_a_training_pair(tokenizer, max_len):
    config = DataConfig(max_sequence_length=max_len)
    encoder = ResponseEncoder(tokenizer, config)
    response = "A quiet, moving film about a family and its long summer."
    pair = {"prompt": PROMPT, "chosen": response, "rejected": "Dull and far too long."}
    expected = training_ids(tokenizer, pair, config)
    got = encoder.encode({"prompt": PROMPT, "response": response}, "row 0").tolist()
    assert got == expected
    assert got[-1] == tokenizer.eos_token_id  # EOS appended, as in training
    assert len(got) <= max_len


def test_chat_rows_tokenize_as_the_chosen_side_of_a_training_pair(tokenizer):
    config = DataConfig(max_sequence_length=512)
    encoder = ResponseEncoder(tokenizer, config)
    prompt = [{"role": "user", "content": "Describe the film in one line."}]
    chosen = [{"role": "assistant", "content": "Warm and funny."}]
    pair = {
        "prompt": prompt,
        "chosen": chosen,
        "rejected": [{"role": "assistant", "content": "Bad."}],
    }
    expected = training_ids(tokenizer, pair, config)
    as_messages = encoder.encode({"messages": prompt + chosen}, "row 0").tolist()
    as_prompt_response = encoder.encode(
        {"prompt": prompt, "response": "Warm and funny."}, "row 1"
    ).tolist()
    assert as_messages == expected
    assert as_prompt_response == expected
    bos = tokenizer.bos_token_id
    assert expected[:2] != [bos, bos]  # the template's own BOS, no second one


def test_text_and_input_ids_rows(tokenizer):
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=64))
    text_ids = encoder.encode({"text": "Just fine."}, "row 0").tolist()
    assert text_ids == [*tokenizer("Just fine.").input_ids, tokenizer.eos_token_id]
    assert encoder.encode({"input_ids": [5, 6, 7]}, "row 1").tolist() == [5, 6, 7]


def test_bad_rows_name_the_row(tokenizer):
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=64))
    with pytest.raises(DataError, match=r"f\.jsonl:3 .*needs `messages`"):
        encoder.encode({"other": 1}, "f.jsonl:3 (row 2)")
    with pytest.raises(DataError, match="field 'response'"):
        encoder.encode({"response": 5}, "row 0")
    with pytest.raises(DataError, match="ids in"):
        encoder.encode({"input_ids": [10**9]}, "row 0")


def test_scorer_is_batch_size_and_padding_invariant(tokenizer, model):
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=64))
    seqs = [
        encoder.encode({"text": t}, f"row {i}") for i, t in enumerate(["a b c", "x", "long " * 20])
    ]
    pad = tokenizer.pad_token_id
    one = RewardScorer(model, pad_id=pad, max_sequence_length=64, batch_size=1)(seqs)
    four = RewardScorer(model, pad_id=pad, max_sequence_length=64, batch_size=4)(seqs)
    np.testing.assert_allclose(one, four, atol=1e-5)
    # Against the model called directly on one unpadded row.
    direct = np.asarray(model(seqs[1][None, :]).logits[:, 0])
    np.testing.assert_allclose(one[1], direct[0], atol=1e-5)


def test_score_file_streams_in_order_and_refuses_overwrite(tokenizer, model, tmp_path):
    rows = [{"id": i, "text": "word " * (1 + (i * 7) % 13)} for i in range(37)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=64))
    scorer = RewardScorer(
        model, pad_id=tokenizer.pad_token_id, max_sequence_length=64, batch_size=4
    )
    out = tmp_path / "out.parquet"
    assert score_file(src, out, encoder, scorer) == 37
    import pyarrow.parquet as pq

    table = pq.read_table(out).to_pylist()
    assert [r["id"] for r in table] == list(range(37))
    expected = scorer([encoder.encode(r, "") for r in rows])
    np.testing.assert_allclose([r["reward"] for r in table], expected, atol=1e-6)
    with pytest.raises(DataError, match="exists; pass --overwrite"):
        score_file(src, out, encoder, scorer)
    assert not list(tmp_path.glob(".out.parquet.tmp-*"))


def test_normalization_needs_stats_and_a_positive_std(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"rewardax": {"trained_steps": 3}}))
    with pytest.raises(ModelLoadError, match=r"no rewardax\.reward_normalization"):
        normalization_of(tmp_path)
    stats = {"rewardax": {"reward_normalization": {"mean": 1.0, "std": 0.0}}}
    (tmp_path / "config.json").write_text(json.dumps(stats))
    with pytest.raises(ModelLoadError, match="std of 0"):
        normalization_of(tmp_path)


# A ChatML template (SmolLM2's shape) whose generation-prompt branch is replaced by `{tail}`.
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}{tail}{% endif %}"
)
_CHAT_ROW = {
    "messages": [
        {"role": "user", "content": "Describe the film in one line."},
        {"role": "assistant", "content": "Warm and funny."},
    ]
}


def test_a_template_that_refuses_the_prompt_alone_gives_no_boundary(tokenizer, monkeypatch):
    """The template's own refusal (raise_exception) of the prompt render is expected: the row is
    scored on the whole chat, as before, with no prompt/response boundary."""
    template = _CHATML.replace("{tail}", "{{ raise_exception('ends on an assistant turn') }}")
    monkeypatch.setattr(tokenizer, "chat_template", template)
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=512))
    rendered = tokenizer.apply_chat_template(_CHAT_ROW["messages"], tokenize=False).rstrip()
    expected = tokenizer(rendered, add_special_tokens=False).input_ids
    if encoder.encoder.adds_bos and expected[0] != tokenizer.bos_token_id:
        expected = [tokenizer.bos_token_id, *expected]
    assert encoder.encode(_CHAT_ROW, "row 0").tolist() == expected


def test_a_python_error_in_the_template_names_the_row(tokenizer, monkeypatch):
    """A template expression failing on the prompt render was swallowed (the row scored as if
    nothing happened); it is a DataError naming the row and what to do."""
    monkeypatch.setattr(tokenizer, "chat_template", _CHATML.replace("{tail}", "{{ 1 // 0 }}"))
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=512))
    with pytest.raises(DataError, match=r"f\.jsonl:5 \(row 4\).*ZeroDivisionError.*input_ids"):
        encoder.encode(_CHAT_ROW, "f.jsonl:5 (row 4)")


def test_an_unexpected_error_while_finding_the_prompt_propagates(tokenizer, monkeypatch):
    """Neither a template refusal nor a row problem (here a RuntimeError, as a failing device or a
    bug would raise): it surfaces unchanged instead of silently dropping the prompt boundary."""
    render = tokenizer.apply_chat_template

    def fails_on_the_prompt(messages, **kwargs):
        if kwargs.get("add_generation_prompt"):
            raise RuntimeError("not a template error")
        return render(messages, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", fails_on_the_prompt)
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=512))
    with pytest.raises(RuntimeError, match="not a template error"):
        encoder.encode(_CHAT_ROW, "row 0")


def bos_adding_tokenizer():
    """A word-level fast tokenizer that adds BOS to every text, as Llama 3's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["a", "b", "c", "d", "e", "f", "g", "h"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )


@pytest.mark.parametrize("max_len", [64, 6])
def test_a_text_that_starts_with_bos_gets_no_second_one(max_len):
    """An RL framework's query is a chat render, BOS included, sent as text: it is encoded with one
    BOS (as the same conversation given as messages is), in scoring and in training alike, and
    keep_end still cuts the prompt after that BOS."""
    tokenizer = bos_adding_tokenizer()
    assert tokenizer("a b").input_ids == [1, 3, 4]
    config = DataConfig(max_sequence_length=max_len)
    encoder = ResponseEncoder(tokenizer, config)
    plain = {"prompt": "a b c d e ", "response": "f g"}
    rendered = {"prompt": "<s>a b c d e ", "response": "f g"}
    want = [1, 3, 4, 5, 6, 7, 8, 9, 2] if max_len == 64 else [1, 6, 7, 8, 9, 2]  # BOS ... g EOS
    assert encoder.encode(plain, "row 0").tolist() == want
    assert encoder.encode(rendered, "row 1").tolist() == want
    assert encoder.encode({"text": "<s>a b c d e f g"}, "row 2").tolist() == want
    for row in (plain, rendered):
        pair = {"prompt": row["prompt"], "chosen": "f g", "rejected": "h"}
        assert training_ids(tokenizer, pair, config) == want


def varied_rows():
    """Rows of every kind a ResponseEncoder takes, long ones (cut by a 24-token limit) and bad
    ones mixed in among the good."""
    user = [{"role": "user", "content": "Describe the film in one line."}]
    long_text = "a b c d e f g h " * 12
    return [
        {"text": "Just fine."},
        {"other": 1},  # no kind
        {"prompt": PROMPT, "response": "A quiet, moving film."},
        {"prompt": "a b c d e ", "response": "a b c d e f g"},  # starts with its prompt
        {"prompt": "", "response": "f g"},
        {"response": 5},  # not a string
        {"prompt": PROMPT + long_text, "response": "Warm."},  # the prompt is cut
        {"text": long_text},
        {"input_ids": [5, 6, 7]},
        {"input_ids": np.arange(3, 43)},  # an integer array, cut
        {"input_ids": [10**9]},  # out of the vocabulary
        {"prompt": user, "response": "Warm and funny."},
        {"messages": [*user, {"role": "assistant", "content": "Bad."}]},
        {"messages": [*user, {"role": "assistant", "content": long_text}]},
        {"messages": "hi"},  # not a list of messages
        {"prompt": 3, "response": "x"},
        {"text": "   "},  # empty
        {"text": "a \ud800"},  # a lone surrogate
        "not an object",
        {"text": "<s>a b c d e f g"},  # a chat render sent as text: its own BOS
        {"prompt": "<s>a b c d e ", "response": "f g h"},
        {"response": long_text, "prompt": "x "},  # the response alone is over the limit
    ]


def outcome(result):
    if isinstance(result, Exception):
        return (
            type(result).__name__,
            result.reason,
            getattr(result, "field_name", None),
            str(result),
        )
    return result


@pytest.mark.parametrize("which", ["smollm2", "adds_bos"])
@pytest.mark.parametrize(
    "mode,append_eos",
    [("keep_end", True), ("keep_start", True), ("filter", True), ("keep_end", False)],
)
def test_fit_many_equals_fit_row_by_row(tokenizer, which, mode, append_eos):
    """All rows tokenized together (one tokenizer call per kind) give each row what it gets
    alone: the same ids, cut flag, or error naming the same field; a bad row spoils no other."""
    tok = tokenizer if which == "smollm2" else bos_adding_tokenizer()
    config = DataConfig(max_sequence_length=24, truncation_mode=mode, append_eos=append_eos)
    encoder = ResponseEncoder(tok, config)
    rows = varied_rows()
    alone = []
    for row in rows:
        try:
            alone.append(encoder.fit(row))
        except (InvalidRow, FilteredPair) as err:
            alone.append(err)
    together = encoder.fit_many(rows)
    assert [outcome(r) for r in together] == [outcome(r) for r in alone]
    # Reordered, each row still gets its own result.
    assert [outcome(r) for r in encoder.fit_many(rows[::-1])] == [outcome(r) for r in alone[::-1]]
    # The rows exercise what they are meant to: kept, cut (or filtered) and bad rows.
    kept = [r for r in together if isinstance(r, tuple)]
    assert len(kept) >= 7 and sum(isinstance(r, InvalidRow) for r in together) >= 8
    if mode == "filter":
        assert sum(isinstance(r, FilteredPair) for r in together) >= 3
    else:
        assert sum(cut for _, cut in kept) >= 3
    # The tokenizer's batch call gives each text the ids of a call of its own.
    texts = ["Just fine.", PROMPT + "a b c d e f g h " * 12, "<s>a b", "x"]
    for special in (True, False):
        one_by_one = [tok(t, add_special_tokens=special).input_ids for t in texts]
        assert encoder.encoder.token_ids(texts, add_special_tokens=special) == one_by_one


def test_a_bad_row_before_an_unreadable_line_is_the_error_reported(tokenizer, model, tmp_path):
    """Rows are tokenized a window at a time, but errors come in file order, as row by row."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n{"response": 5}\nnot json\n')
    encoder = ResponseEncoder(tokenizer, DataConfig(max_sequence_length=64))
    scorer = RewardScorer(
        model, pad_id=tokenizer.pad_token_id, max_sequence_length=64, batch_size=4
    )
    with pytest.raises(DataError, match=r"in\.jsonl:2 \(row 1\), field 'response'"):
        score_file(src, tmp_path / "out.jsonl", encoder, scorer)
    src.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError, match=r"in\.jsonl:2 \(row 1\): not valid JSON"):
        score_file(src, tmp_path / "out.jsonl", encoder, scorer)


def test_common_prefix_of_a_prompt_render_and_its_chat():
    from rewardax.scoring import _common_prefix

    assert _common_prefix("<s>user: hi\nassistant:", "<s>user: hi\nassistant: yes") == 22
    assert _common_prefix("<s>user: hi\nassistant:\n", "<s>user: hi\nassistant: yes") == 22
    assert _common_prefix("", "abc") == 0
    assert _common_prefix("abc", "ab") == 2
