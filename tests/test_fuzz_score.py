"""Property-based fuzzing of the `score` path with malformed rows and files (issue #8).

Every outcome must be a scored row or a rewardax error naming the row (or file line): never a hang,
never an uncaught exception from json, numpy, the tokenizer or JAX. Over 1,000 generated rows per
run, deterministic (derandomize=True), on a tiny random model whose calls are batched.
"""

from __future__ import annotations

import json
import math
import signal

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewardax as rx
from data_fixtures import smollm2_tokenizer
from rewardax import cli
from rewardax.config import RewardConfig
from rewardax.errors import DataError
from rewardax.scoring import ResponseEncoder, RewardScorer, pad_id_of, score_file, score_rows

MAX_LEN = 32
FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure is reproducible
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
ROWS_FUZZED = {"rows": 0, "scored": 0, "rejected": 0, "files_ok": 0, "files_rejected": 0}


class Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hang("one example took more than 60 s")


@pytest.fixture(autouse=True)
def no_hang():
    """Each test (all its examples) must finish in bounded time: SIGALRM turns a hang into a failure."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(600)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def scoring(tmp_path_factory):
    tokenizer = smollm2_tokenizer()
    config = rx.ModelConfig(
        architecture="llama",
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = rx.RewardModel(config, rngs=nnx.Rngs(0))
    model_dir = tmp_path_factory.mktemp("fuzz-score") / "model"
    model.save_pretrained(model_dir, tokenizer=tokenizer)
    data = RewardConfig().with_overrides([f"data.max_sequence_length={MAX_LEN}"]).data
    encoder = ResponseEncoder(tokenizer, data)
    scorer = RewardScorer(
        model, pad_id=pad_id_of(tokenizer), max_sequence_length=MAX_LEN, batch_size=16
    )
    return {"encoder": encoder, "scorer": scorer, "model_dir": model_dir, "vocab": len(tokenizer)}


# ------------------------------------------------------------------------------------ strategies

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=3000),  # huge
    st.just(""),
    st.just("   "),
    st.just("\ud800 lone surrogate"),
    st.just("{{ ''.__class__.__mro__[1].__subclasses__() }}{% raw %}"),  # Jinja as text
    st.just("__import__('os').system('touch /tmp/rewardax-pwned')"),
)
role = st.sampled_from(["user", "assistant", "system", "tool", "robot", "", None, 3, ["user"]])
message = st.one_of(
    st.fixed_dictionaries({"role": role, "content": st.one_of(text, junk)}),
    st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]), junk, max_size=3),
    junk,
)
messages = st.one_of(
    st.lists(message, max_size=4),
    st.lists(st.fixed_dictionaries({"role": role, "content": text}), min_size=1, max_size=3),
)
token_ids = st.one_of(
    st.lists(st.integers(-5, 60_000), max_size=40),
    st.lists(
        st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.booleans(), st.text(max_size=3)),
        max_size=5,
    ),
    st.text(max_size=10),
)
value = st.one_of(text, messages, token_ids, junk)
keys = st.sampled_from(
    [
        "messages",
        "input_ids",
        "response",
        "prompt",
        "text",
        "tools",
        "chat_template_kwargs",
        "reward",
        "id",
    ]
)
rows = st.one_of(
    st.dictionaries(keys, value, max_size=4),
    st.fixed_dictionaries(
        {"messages": messages}, optional={"tools": junk, "chat_template_kwargs": junk}
    ),
    st.fixed_dictionaries({"input_ids": token_ids}),
    st.fixed_dictionaries({"response": text}, optional={"prompt": st.one_of(text, messages, junk)}),
    st.fixed_dictionaries({"text": text}, optional={"id": junk}),
    junk,  # not an object at all
)


def _check_scored(out_rows: list[dict], inputs: list[dict]) -> None:
    assert len(out_rows) == len(inputs)
    for got, row in zip(out_rows, inputs, strict=True):
        reward = got.pop("reward")
        assert isinstance(reward, float) and math.isfinite(reward)
        assert got.keys() == row.keys()  # every other column is carried through


@settings(FUZZ, max_examples=250)
@given(batch=st.lists(rows, min_size=1, max_size=10))
def test_every_row_is_scored_or_named_in_a_rewardax_error(scoring, batch):
    """Encode row by row (each valid or a DataError naming it); score the valid ones in one batch."""
    ROWS_FUZZED["rows"] += len(batch)
    encoder, scorer = scoring["encoder"], scoring["scorer"]
    valid = []
    for i, row in enumerate(batch):
        where = f"fuzz.jsonl:{i + 1} (row {i})"
        try:
            ids = encoder.encode(row, where)
        except DataError as error:
            assert str(error).startswith(where), str(error)
            ROWS_FUZZED["rejected"] += 1
            continue
        assert ids.dtype == np.int32 and 1 <= len(ids) <= MAX_LEN
        assert ((ids >= 0) & (ids < scoring["vocab"])).all()
        valid.append((row, where))
    out: list[dict] = []
    try:
        for window in score_rows(valid, encoder, scorer):
            out.extend(window)
    except DataError as error:  # only the reward-column clash is left at this stage
        assert "already has a `reward` column" in str(error) and "(row " in str(error)
        assert any("reward" in row for row, _ in valid)
        return
    _check_scored(out, [row for row, _ in valid])
    ROWS_FUZZED["scored"] += len(out)


# Lines of a jsonl file as bytes: valid rows, rows with trailing garbage, invalid UTF-8, JSON that is
# not an object, nesting deeper than any parser allows, blank lines, random bytes.
def _json_bytes(row, ascii_only: bool) -> bytes:
    # surrogatepass: a lone surrogate written raw is invalid UTF-8, as a broken producer writes it.
    return json.dumps(row, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


line = st.one_of(
    st.builds(_json_bytes, rows, st.booleans()),
    st.builds(_json_bytes, rows, st.booleans()),
    st.builds(
        lambda r, g: _json_bytes(r, True) + g,
        rows,
        st.sampled_from([b"}", b" x", b"{}", b",", b"\x00"]),
    ),
    st.sampled_from(
        [b"\xff\xfe{}", b'{"text": "\xc3\x28"}', b'\xef\xbb\xbf{"text": "bom"}', b"\x80"]
    ),
    st.sampled_from([b"", b"   ", b"\t", b"null", b"[1, 2]", b'"text"', b"NaN", b"1e999"]),
    st.sampled_from([10, 3000, 200_000]).map(lambda n: b"[" * n + b"]" * n),
    st.sampled_from([3000, 200_000]).map(lambda n: b'{"text": "' + b"ab " * n + b'"}'),
    st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")),
)


# Rows that must score (short texts: at most 12 characters fit MAX_LEN tokens), so files without a
# bad line are common enough to check the written output too.
good_row = st.fixed_dictionaries(
    {"text": st.text(min_size=1, max_size=12).filter(str.strip)}, optional={"id": junk}
)
good_line = st.builds(_json_bytes, good_row, st.booleans())
lines_of_a_file = st.one_of(
    st.lists(line, min_size=1, max_size=8),
    st.lists(good_line, min_size=1, max_size=6),
    st.tuples(st.lists(good_line, max_size=4), line).map(lambda t: [*t[0], t[1]]),
)


@settings(FUZZ, max_examples=150)
@given(lines=lines_of_a_file)
def test_score_file_writes_every_row_or_names_the_line(scoring, tmp_path_factory, lines):
    ROWS_FUZZED["rows"] += len(lines)
    tmp = tmp_path_factory.mktemp("fz")
    source, target = tmp / "in.jsonl", tmp / "out.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    try:
        count = score_file(source, target, scoring["encoder"], scoring["scorer"])
    except DataError as error:
        message = str(error)
        assert message.startswith(f"{source}:") or message.startswith(f"input file {source}"), (
            message
        )
        if message.startswith(f"{source}:"):
            number = int(message[len(str(source)) + 1 :].split(" ")[0])
            assert 1 <= number <= len(lines)
        # Complete or absent: no output and no temporary file left behind.
        assert sorted(p.name for p in tmp.iterdir()) == ["in.jsonl"]
        ROWS_FUZZED["files_rejected"] += 1
        return
    texts = [raw.decode("utf-8") for raw in lines]
    inputs = [json.loads(t) for t in texts if t.strip()]
    # Split on "\n" only: str.splitlines would also split inside strings at U+0085 / U+2028.
    out = [json.loads(t) for t in target.read_text(encoding="utf-8").split("\n")[:-1]]
    assert count == len(inputs)
    _check_scored(out, inputs)
    ROWS_FUZZED["files_ok"] += 1


@pytest.mark.slow  # 10 s: the two fuzz tests above again, counting
def test_at_least_1000_rows_were_fuzzed(scoring, tmp_path_factory):
    """The fuzz tests above reach both outcomes on enough rows. Self-sufficient: it runs them
    itself (all their examples, derandomized, so the same ones as above; a few seconds) on fresh
    counts, rather than reading counts that exist only when they ran first in this session."""
    ROWS_FUZZED.update(dict.fromkeys(ROWS_FUZZED, 0))
    test_every_row_is_scored_or_named_in_a_rewardax_error(scoring=scoring)
    test_score_file_writes_every_row_or_names_the_line(
        scoring=scoring, tmp_path_factory=tmp_path_factory
    )
    assert ROWS_FUZZED["rows"] >= 1000, ROWS_FUZZED
    # Both outcomes were exercised, not only the error path.
    assert ROWS_FUZZED["scored"] >= 100 and ROWS_FUZZED["rejected"] >= 100, ROWS_FUZZED
    assert ROWS_FUZZED["files_ok"] >= 10 and ROWS_FUZZED["files_rejected"] >= 10, ROWS_FUZZED
    print(ROWS_FUZZED)


# ----------------------------------------------------------------------------------- the command

CLI_CASES = [
    (b'{"text": "a fine answer"}\n{"response": "ok", "prompt": "Q: "}\n', 0, None),
    (b'{"text": "fine"}\n{"text": "bad \xff utf-8"}\n', 2, ":2 (row 1): not valid UTF-8"),
    (b'{"text": "fine"}\n{"text": "x"} trailing\n', 2, ":2 (row 1): not valid JSON"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}\n', 2, ":1 (row 0), field 'messages[0]'"),
    (b'{"messages": []}\n', 2, ":1 (row 0), field 'messages'"),
    (b'{"input_ids": [1, 1e999]}\n', 2, ":1 (row 0), field 'input_ids'"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", 2, ":1 (row 0): JSON nested too deeply"),
    (b'{"text": "\\ud800"}\n', 2, ":1 (row 0), field 'text'"),
]


@pytest.mark.parametrize("content,code,needle", CLI_CASES, ids=range(len(CLI_CASES)))
def test_cli_score_outcome_is_output_or_one_error_line(
    scoring, tmp_path, capsys, content, code, needle
):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(content)
    args = ["score", "--model", str(scoring["model_dir"]), "--input", str(source)]
    got = cli.main([*args, "--output", str(target), "--max-length", str(MAX_LEN)])
    out, err = capsys.readouterr()
    assert got == code, err[-2000:]
    if code == 0:
        assert json.loads(out.strip().splitlines()[-1])["rows"] == 2
        assert len(target.read_text().splitlines()) == 2
    else:
        errors = [line for line in err.splitlines() if line.startswith("rewardax: error:")]
        assert len(errors) == 1 and f"{source}{needle}" in errors[0], err[-2000:]
        assert not target.exists()
