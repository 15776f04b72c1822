"""Score single responses with a trained reward model: batched, streaming, in bounded memory.

A row to score is one of (checked in this order; other columns are carried through untouched):
  - `messages`: a chat, a list of `{"role", "content"}` messages; the chat template renders it and the
    reward is read at the last token (the end of the last message). Optional `tools` and
    `chat_template_kwargs` columns go to the template, as in training.
  - `input_ids`: a list of token ids, scored as is (nothing appended, as pre-tokenized training rows).
  - `response`, with an optional `prompt`: a string prompt is prepended to the response (unless the
    response already starts with it); a list-of-messages prompt makes it a chat whose last message is
    `{"role": "assistant", "content": response}`.
  - `text`: one string, scored as is.
Tokenization follows the training rules of `rewardax.data.tokenize.PairEncoder` (its own tokenize and
length-policy steps do the work; tests/test_scoring.py checks the ids equal a training pair's): plain text gets the tokenizer's special tokens and an EOS unless it ends with one
(`data.append_eos`), chat renders get no second BOS, and sequences longer than
`data.max_sequence_length` are cut by `data.truncation_mode` exactly as a training response is. So
the reward of a response here equals its reward as the `chosen` side of a training pair.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rewardax.data.collate import default_bucket_lengths
from rewardax.data.config import DataConfig
from rewardax.data.formats import (
    InvalidRow,
    NormalizedPair,
    chat_extras,
    check_encodable,
    checked_messages,
)
from rewardax.data.tokenize import EncodedSequence, FilteredPair, PairEncoder, pad_token_id
from rewardax.errors import ConfigError, DataError, ModelLoadError

SCORE_SUFFIXES = (".jsonl", ".ndjson", ".parquet")
ROW_KINDS = ("messages", "input_ids", "response", "text")


class ResponseEncoder:
    """One response row -> token ids, with the training tokenization rules (module docstring).

    Args:
      tokenizer: the model's tokenizer (`rewardax.load_tokenizer`).
      data_config: the `data` settings the model was trained with (max_sequence_length,
        truncation_mode, append_eos).
    """

    def __init__(self, tokenizer: Any, data_config: DataConfig):
        self.config = data_config
        self.encoder = PairEncoder.for_data(tokenizer, data_config)

    def _chat_text(self, messages: list[dict], row: dict) -> _Text:
        """The render of a chat, to encode without special tokens, with its prompt boundary."""
        enc = self.encoder
        tools, kwargs = chat_extras(row)
        pair = NormalizedPair("chat", messages, messages, tools=tools, template_kwargs=kwargs)
        full = enc.render(messages, pair, "messages")
        # Training puts the prompt/response boundary at the end of the text two responses share: the
        # rendered prompt plus the assistant header, which is the generation-prompt render.
        head = ""
        if len(messages) > 1:
            try:
                head = enc.tokenizer.apply_chat_template(
                    messages[:-1], tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
                )
            except _template_errors():
                # The template refuses a conversation that stops before the assistant turn (its
                # raise_exception, a name it needs undefined): then there is no prompt boundary,
                # and keep_end truncation counts the whole sequence as response.
                head = ""
            except (TypeError, ValueError, ArithmeticError, LookupError) as err:
                # Python errors of the template's own expressions on this row's values. Anything
                # else (a rewardax bug, out of memory) propagates as it is.
                raise InvalidRow(
                    "chat_template",
                    "messages",
                    "the tokenizer's chat template renders the whole chat but fails on its prompt "
                    "(the messages before the last, with the generation prompt): "
                    f"{type(err).__name__}: {err}. Fix the template, or score this row as "
                    "`input_ids`",
                ) from None
        return _Text(full, _common_prefix(head, full), plain=False)

    def sequences_many(self, rows: Sequence[Any]) -> list[EncodedSequence | InvalidRow]:
        """The sequence of each row before the length policy, or the InvalidRow it raised.

        Every row is checked (and chat rows rendered) first; then the plain texts are tokenized in
        one tokenizer call and the chat renders in another (`PairEncoder.token_ids`), as
        `PairEncoder.encode_many` tokenizes pairs. A batch gives each text the ids it gets alone.
        """
        enc = self.encoder
        out: list[Any] = [None] * len(rows)
        texts: dict[bool, list[tuple[int, _Text]]] = {True: [], False: []}
        for i, row in enumerate(rows):
            try:
                prepared = self._row_input(row)
            except InvalidRow as bad:
                out[i] = bad
                continue
            if isinstance(prepared, EncodedSequence):  # input_ids: nothing to tokenize
                out[i] = prepared
            else:
                texts[prepared.plain].append((i, prepared))
        for plain, jobs in texts.items():
            ids = enc.token_ids([job.text for _, job in jobs], add_special_tokens=plain)
            sequence = enc.plain_sequence if plain else enc.rendered_sequence  # the training rules
            for (i, job), seq_ids in zip(jobs, ids, strict=True):
                out[i] = sequence(seq_ids, job.text, job.prompt_chars)
        return out

    def fit_many(
        self, rows: Sequence[Any]
    ) -> list[tuple[list[int], bool] | InvalidRow | FilteredPair]:
        """`fit` of many rows, tokenized together (`sequences_many`): per row its (ids, cut), or
        the InvalidRow / FilteredPair that `fit` would raise, so one bad row never stops the
        others."""
        out: list[tuple[list[int], bool] | InvalidRow | FilteredPair] = []
        for seq in self.sequences_many(rows):
            if isinstance(seq, InvalidRow):
                out.append(seq)
                continue
            try:
                out.append(self.encoder.fit(seq, "response"))
            except (InvalidRow, FilteredPair) as err:
                out.append(err)
        return out

    def fit(self, row: Any) -> tuple[list[int], bool]:
        """Token ids of one row after the length policy, and whether they were cut; raises
        InvalidRow for a bad row and FilteredPair when truncation_mode=filter drops it (training
        on score and ranked rows, `rewardax.data.groups`, counts those)."""
        result = self.fit_many([row])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def encode_many(self, rows: Sequence[Any], wheres: Sequence[str]) -> list[np.ndarray]:
        """Token ids int32 [L] of each row (L <= max_sequence_length), tokenized together; the
        first bad row, in order, raises a DataError naming its `where`."""
        out = []
        for result, where in zip(self.fit_many(rows), wheres, strict=True):
            if isinstance(result, FilteredPair):
                result = InvalidRow(
                    "too_long",
                    "response",
                    f"longer than max_sequence_length={self.config.max_sequence_length} and "
                    "truncation_mode is filter, but scoring keeps every row; use --truncation "
                    "keep_end or keep_start, or raise --max-length",
                )
            if isinstance(result, InvalidRow):
                raise DataError(f"{where}, field '{result.field_name}': {result.expected}")
            out.append(np.asarray(result[0], dtype=np.int32))
        return out

    def encode(self, row: Any, where: str) -> np.ndarray:
        """Token ids int32 [L] of one row (L <= max_sequence_length); DataError naming `where`."""
        return self.encode_many([row], [where])[0]

    def _row_input(self, row: Any) -> EncodedSequence | _Text:
        """A checked row: its sequence (input_ids) or the text to tokenize (`_Text`)."""
        if not isinstance(row, dict):
            raise InvalidRow("wrong_type", "<row>", f"expected an object, got {type(row).__name__}")
        # A lone surrogate (a JSON "\\ud800" escape) would crash the tokenizer in Rust.
        check_encodable(row, "")
        if row.get("messages") is not None:
            messages = checked_messages(row["messages"], "messages", response=True)
            return self._chat_text(messages, row)
        if row.get("input_ids") is not None:
            ids = row["input_ids"]
            if isinstance(ids, np.ndarray) and np.issubdtype(ids.dtype, np.integer):
                ids = ids.tolist()
            # Integers only: int() would also take "12" (a string of digits), True, 3.7 or inf.
            if not isinstance(ids, list | tuple) or not all(
                isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids
            ):
                raise InvalidRow("wrong_type", "input_ids", "expected a list of integer token ids")
            ids = [int(t) for t in ids]
            bad = [t for t in ids if not 0 <= t < self.encoder.vocab_size]
            if not ids or bad:
                raise InvalidRow(
                    "bad_token_id",
                    "input_ids",
                    f"expected a non-empty list of ids in [0, {self.encoder.vocab_size})",
                )
            return EncodedSequence(ids, None, 0, False, prompt_tokens=0)
        if row.get("response") is not None:
            response = _string(row, "response")
            prompt = row.get("prompt")
            if isinstance(prompt, list):
                messages = checked_messages(prompt, "prompt", response=False)
                return self._chat_text([*messages, {"role": "assistant", "content": response}], row)
            if prompt is None or prompt == "":
                return _Text(response, 0, plain=True)
            if not isinstance(prompt, str):
                raise InvalidRow(
                    "wrong_type", "prompt", "expected a string or a list of chat messages"
                )
            text = response if response.startswith(prompt) else prompt + response
            return _Text(text, len(prompt), plain=True)
        if row.get("text") is not None:
            return _Text(_string(row, "text"), 0, plain=True)
        raise InvalidRow(
            "missing_field",
            "messages",
            "a row to score needs `messages` (chat), `input_ids`, `response` (with an optional "
            f"`prompt`) or `text`; it has {sorted(row)[:8]}",
        )


class _Text(NamedTuple):
    """A row's text to tokenize: plain text (`plain`: encoded with the tokenizer's special tokens)
    or a chat render (encoded without: the template writes its own), and where its prompt ends."""

    text: str
    prompt_chars: int
    plain: bool


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``: usually all of ``a`` (a chat's
    generation-prompt render starts its whole render), found then by one C-speed comparison."""
    if b.startswith(a):
        return len(a)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _template_errors() -> tuple[type[BaseException], ...]:
    """jinja2's TemplateError (raise_exception in a template, an undefined name, a syntax error).

    Taken from the jinja2 that transformers loaded to render templates: rewardax never imports
    jinja2 itself (tests/test_security.py; templates run only in transformers' sandbox). If it is
    not loaded, no template ran, and there is nothing to catch.
    """
    module = sys.modules.get("jinja2.exceptions")
    return (module.TemplateError,) if module is not None else ()


def _string(row: dict, name: str) -> str:
    value = row[name]
    if not isinstance(value, str):
        raise InvalidRow("wrong_type", name, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidRow("empty_field", name, "expected a non-empty string")
    return value


class RewardScorer:
    """Rewards of token sequences, batched, with a fixed set of padded shapes (few compilations).

    Args:
      model: a `RewardModel`.
      pad_id: the id written in padding (never read: the reward is at the last mask-1 position).
      max_sequence_length: the longest sequence; shapes are the data module's bucket lengths.
      batch_size: sequences per forward pass; a short last batch is padded to this size.

    Example:
      scorer = RewardScorer(model, pad_id=2, max_sequence_length=64, batch_size=16)
      scorer([np.array([1, 5, 9, 2]), np.array([1, 7, 2])])  # -> float64 [2]
    """

    def __init__(self, model: Any, *, pad_id: int, max_sequence_length: int, batch_size: int):
        if batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, got {batch_size}")
        self.pad_id = int(pad_id)
        self.batch_size = int(batch_size)
        self.buckets = default_bucket_lengths(max_sequence_length)
        graphdef, state = nnx.split(model)

        # A named head (model.objectives: config.json's id2label) has each output scored by name.
        names = getattr(getattr(model, "config", None), "label_names", None)
        self.label_names = tuple(names) if names else None

        @jax.jit
        def forward(state, input_ids, attention_mask):
            # Column 0 of the head is the reward (num_labels > 1 heads carry extra outputs).
            return nnx.merge(graphdef, state)(input_ids, attention_mask).logits

        self._state, self._forward = state, forward

    def __call__(self, sequences: list[np.ndarray]) -> np.ndarray:
        """Rewards float64 [N] of N int32 sequences (any N; batched internally)."""
        return self.outputs(sequences)[:, 0]

    def outputs(self, sequences: list[np.ndarray]) -> np.ndarray:
        """Every head output, float64 [N, num_labels] (column 0 the reward)."""
        out = None
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            longest = max(len(s) for s in chunk)
            length = next((b for b in self.buckets if b >= longest), longest)
            ids = np.full((self.batch_size, length), self.pad_id, dtype=np.int32)
            mask = np.zeros((self.batch_size, length), dtype=np.int32)
            for i, seq in enumerate(chunk):
                ids[i, : len(seq)] = seq
                mask[i, : len(seq)] = 1
            logits = np.asarray(self._forward(self._state, jnp.asarray(ids), jnp.asarray(mask)))
            if out is None:
                out = np.empty((len(sequences), logits.shape[-1]), dtype=np.float64)
            out[start : start + len(chunk)] = logits[: len(chunk)]
        return out if out is not None else np.empty((0, 1), dtype=np.float64)


def normalization_of(model_dir: str | os.PathLike) -> dict[str, float]:
    """The `{"mean", "std"}` stored under config.json's `rewardax.reward_normalization`."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read {path} for the reward normalisation: {error}") from None
    stats = (config.get("rewardax") or {}).get("reward_normalization")
    if not isinstance(stats, dict) or not {"mean", "std"} <= set(stats):
        raise ModelLoadError(
            f"{path} has no rewardax.reward_normalization (mean/std); only models exported by "
            "`rewardax train` with an eval set carry it. Score without --normalize."
        )
    mean, std = float(stats["mean"]), float(stats["std"])
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ModelLoadError(
            f"{path}: reward_normalization has mean={mean}, std={std}; a std of 0 (constant "
            "rewards) cannot normalise. Score without --normalize."
        )
    return {"mean": mean, "std": std}


def iter_rows(path: str | os.PathLike, read_batch: int = 1024) -> Iterator[tuple[dict, str]]:
    """(row, where) of a .jsonl/.ndjson or .parquet file, streamed (never the whole file in memory)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=read_batch):
            for row in batch.to_pylist():
                yield row, f"{path} (row {index})"
                index += 1
        return
    # Bytes, decoded line by line: an invalid UTF-8 line is then reported with its number.
    with open(path, "rb") as fh:
        index = 0
        for number, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{path}:{number} (row {index}): not valid UTF-8 ({error})"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{path}:{number} (row {index}): not valid JSON ({error})"
                ) from None
            except RecursionError:
                raise DataError(
                    f"{path}:{number} (row {index}): JSON nested too deeply to read"
                ) from None
            yield row, f"{path}:{number} (row {index})"
            index += 1


def count_rows(path: str | os.PathLike) -> int | None:
    """Row count when it is cheap to know (parquet metadata), else None."""
    if Path(path).suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return None


class _Writer:
    """Writes rows to a temporary file next to `output`; `commit()` renames it into place."""

    def __init__(self, output: Path):
        self.output = output
        fd, name = tempfile.mkstemp(prefix=f".{output.name}.tmp-", dir=output.parent)
        os.close(fd)
        self.tmp = Path(name)
        self.parquet = output.suffix == ".parquet"
        self._pq_writer = None
        self._fh = None if self.parquet else open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115

    def write(self, rows: list[dict]) -> None:
        if not self.parquet:
            for row in rows:
                line = json.dumps(row, ensure_ascii=False)
                try:
                    line.encode("utf-8")
                except UnicodeEncodeError:  # a lone surrogate in a carried column: keep it escaped
                    line = json.dumps(row)
                self._fh.write(line + "\n")
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._pq_writer is None:
            table = pa.Table.from_pylist(rows)
            self._pq_writer = pq.ParquetWriter(self.tmp, table.schema)
        else:
            try:
                table = pa.Table.from_pylist(rows, schema=self._pq_writer.schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as error:
                raise DataError(
                    f"rows for {self.output} change their column types ({error}); parquet needs one "
                    "schema: write .jsonl instead"
                ) from None
        self._pq_writer.write_table(table)

    def commit(self) -> None:
        self.close()
        os.replace(self.tmp, self.output)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._pq_writer is not None:
            self._pq_writer.close()
            self._pq_writer = None

    def discard(self) -> None:
        self.close()
        self.tmp.unlink(missing_ok=True)


def score_rows(
    rows: Iterable[tuple[dict, str]],
    encoder: ResponseEncoder,
    scorer: RewardScorer,
    *,
    normalization: dict[str, float] | None = None,
    window: int | None = None,
) -> Iterator[list[dict]]:
    """Yields the rows, in input order, each with a float `reward`, a window at a time.

    A window (default 8 batches) is tokenized, sorted by length so each batch pads little, scored,
    and handed back in the input order; memory holds one window, whatever the file size.
    With `normalization`, reward = (r - mean) / std. A model with named outputs (model.objectives;
    `scorer.label_names`) also gets `rewards`: {objective: its output} (not normalised; `reward`
    is the first objective's).
    """
    window = window or 8 * scorer.batch_size
    buffer: list[tuple[dict, str]] = []
    names = scorer.label_names
    added = ("reward", "rewards") if names else ("reward",)

    def encoded() -> list[np.ndarray]:
        # The window's rows in one tokenizer call per kind; the first bad row raises, naming it.
        return encoder.encode_many([row for row, _ in buffer], [where for _, where in buffer])

    def flush() -> list[dict]:
        seqs = encoded()
        order = sorted(range(len(buffer)), key=lambda i: len(seqs[i]))
        outputs = np.empty((len(buffer), len(names) if names else 1))
        outputs[order] = scorer.outputs([seqs[i] for i in order])[:, : outputs.shape[1]]
        rewards = outputs[:, 0]
        if normalization is not None:
            rewards = (rewards - normalization["mean"]) / normalization["std"]
        out = []
        for i, ((row, where), reward) in enumerate(zip(buffer, rewards, strict=True)):
            for column in added:
                if column in row:
                    raise DataError(
                        f"{where}: the input already has a `{column}` column; rename it so it "
                        "is not overwritten"
                    )
            scored = {**row, "reward": float(reward)}
            if names:
                scored["rewards"] = {n: float(v) for n, v in zip(names, outputs[i], strict=True)}
            out.append(scored)
        buffer.clear()
        return out

    reader = iter(rows)
    while True:
        try:
            row, where = next(reader)
        except StopIteration:
            break
        except DataError:
            # A line that cannot be read: a bad row read before it is still the error reported
            # (as when each row was tokenized as it was read).
            encoded()
            raise
        buffer.append((row, where))
        if len(buffer) >= window:
            yield flush()
    if buffer:
        yield flush()


def score_file(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    encoder: ResponseEncoder,
    scorer: RewardScorer,
    *,
    normalization: dict[str, float] | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Scores every row of `input_path` into `output_path` (jsonl or parquet, by suffix).

    The output is written to a temporary file and renamed at the end, so it is complete or absent;
    an existing output is replaced only with `overwrite`. Returns the number of rows written.
    `progress(n)` is called with the rows done after each window.
    """
    source, target = Path(input_path), Path(output_path)
    for path, what in ((source, "input"), (target, "output")):
        if path.suffix not in SCORE_SUFFIXES:
            raise DataError(f"{what} file {path}: use one of {', '.join(SCORE_SUFFIXES)}")
    if not source.is_file():
        raise DataError(f"input file {source} does not exist")
    if target.exists() and not overwrite:
        raise DataError(f"output file {target} exists; pass --overwrite to replace it")
    if target.resolve() == source.resolve():
        raise DataError(f"output {target} is the input file; write to another path")
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = _Writer(target)
    count = 0
    try:
        for rows in score_rows(iter_rows(source), encoder, scorer, normalization=normalization):
            writer.write(rows)
            count += len(rows)
            if progress is not None:
                progress(len(rows))
        if count == 0:
            raise DataError(f"input file {source} holds no rows")
        writer.commit()
    except BaseException:
        writer.discard()
        raise
    return count


def pad_id_of(tokenizer: Any) -> int:
    """The pad id rewardax pads with (see `rewardax.data.pad_token_id`)."""
    return pad_token_id(tokenizer)
