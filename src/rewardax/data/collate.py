"""Rows -> records (per row) -> one numpy batch; the two collate functions of the reference API.

Batch format (what the jitted step receives; numpy, the pair axis explicit):
  input_ids       int32   [B, 2, T]  index 0 = chosen, 1 = rejected; right-padded with the pad id.
  attention_mask  int32   [B, 2, T]  1 for real tokens.
  reward_index    int32   [B, 2]     position of each response's reward token (its last real token);
                                     0 for padding pairs.
  margin          float32 [B]        0 when the data has none.
  pair_mask       float32 [B]        1 for real pairs, 0 for padding pairs.
T is the smallest bucket length that holds the longest sequence of the batch. Packed rows (the
performance issue) will add `segment_ids`; nothing here assumes one pair per row beyond these keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rewardax.data.config import DataConfig
from rewardax.data.formats import InvalidRow, detect_format, normalize_row
from rewardax.data.tokenize import FilteredPair, PairEncoder, pad_token_id
from rewardax.errors import DataError

BATCH_KEYS = ("input_ids", "attention_mask", "reward_index", "margin", "pair_mask")


# The default ladder has twice `buckets_per_octave` steps per doubling from this length on.
FINER_RUNGS_FROM = 1024


def default_bucket_lengths(
    max_sequence_length: int,
    bucket_lengths: Sequence[int] = (),
    buckets_per_octave: int = 4,
    *,
    longer_rows: bool = False,
) -> tuple[int, ...]:
    """Sorted bucket lengths (the padded T a batch may have), the longest at least
    max_sequence_length so that every sequence fits.

    Given `bucket_lengths` are used, capped at the max unless `longer_rows` (packed rows, which
    hold several sequences: a row longer than the longest sequence is useful there); the max is
    added when no given length reaches it. Otherwise a ladder of `buckets_per_octave` equal steps
    per doubling; below 32 the steps are those of the 32..64 octave. With 4 (the default):
    8, 16, ..., 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, ...; with 1: 32, 64, 128, ...
    From `FINER_RUNGS_FROM` (1024) tokens on the steps are twice as many (1024, 1152, 1280, ...
    with 4). A batch padded up to the next rung wastes at most 1/(1 + buckets_per_octave) of it
    (20% with 4, 11% with 8), about half that on average; each rung a run meets is one XLA
    compilation. Past 1024 tokens a step takes seconds on a CPU, so the padding a coarse rung
    adds to every step costs more than the few extra compilations (issue #7's shared-prompt
    rows of ~1,070 tokens: 8 x 1152 instead of 8 x 1280, 1.78 -> 1.51 s a step).
    """
    if bucket_lengths:
        given = {int(b) for b in bucket_lengths if int(b) > 0}
        if longer_rows and max(given, default=0) >= max_sequence_length:
            return tuple(sorted(given))
        buckets = {b for b in given if b <= max_sequence_length}
    else:
        per_octave = max(int(buckets_per_octave), 1)
        buckets, b = set(), max(32 // per_octave, 1)
        while b < max_sequence_length:
            buckets.add(b)
            octave = 1 << (b.bit_length() - 1)  # the power of two at or below b
            steps = per_octave * (2 if b >= FINER_RUNGS_FROM else 1)
            b += max(max(octave, 32) // steps, 1)
    buckets.add(int(max_sequence_length))
    return tuple(sorted(buckets))


class RowProcessor:
    """Row -> record. Picklable, so Grain worker processes can run it.

    `process(row, index, where)` returns a record dict or `{"dropped": reason, "message": text}`
    (never raises for bad rows: the caller decides between error and skip).
    """

    def __init__(self, tokenizer: Any, config: DataConfig, fmt: str | None = None):
        self.config = config
        self.fmt = fmt
        self.encoder = PairEncoder.for_data(tokenizer, config)

    def process(self, row: Any, index: int, where: str) -> dict:
        """One row -> its record (see `process_many`)."""
        return self.process_many([row], [index], lambda _: where)[0]

    def process_many(
        self, rows: Sequence[Any], indices: Sequence[int], where: Callable[[int], str]
    ) -> list[dict]:
        """Rows -> records, tokenized together (one tokenizer call per chunk, not per row).

        Args:
          rows: raw rows; indices: their source row numbers; where: source row number -> how an
            error message names it (called only for bad rows).
        Returns:
          one dict per row: a record with its `index`, or `{"dropped": reason, "message": text,
          "index": i, "fatal": bool}`.
        """
        out: list[dict | None] = [None] * len(rows)
        pairs, slots = [], []
        for k, (row, index) in enumerate(zip(rows, indices, strict=True)):
            fmt = self.fmt or detect_format(row) or "standard"
            try:
                pairs.append(
                    normalize_row(
                        row,
                        fmt,
                        margin_from_scores=self.config.margin_from_scores,
                        margin_scale=self.config.margin_scale,
                    )
                )
                slots.append(k)
            except InvalidRow as bad:
                out[k] = self._invalid(bad, index, where)
        for k, result in zip(slots, self.encoder.encode_many(pairs), strict=True):
            index = indices[k]
            if isinstance(result, InvalidRow):
                out[k] = self._invalid(result, index, where)
            elif isinstance(result, FilteredPair):
                out[k] = {
                    "dropped": result.reason,
                    "message": f"{where(index)}: {result.reason}",
                    "index": index,
                    "fatal": False,
                }
            else:
                result["index"] = index
                out[k] = result
        return out  # type: ignore[return-value]

    @staticmethod
    def _invalid(bad: InvalidRow, index: int, where: Callable[[int], str]) -> dict:
        message = (
            f"{where(index)}, field '{bad.field_name}': {bad.expected}. Fix the row, or set "
            "data.on_invalid=skip to drop such rows (they are counted by reason)."
        )
        return {"dropped": bad.reason, "message": message, "index": index, "fatal": True}


def raise_or_none(record: dict, on_invalid: str) -> dict | None:
    """A record, None for a dropped row, or DataError when on_invalid == 'error' and the row is bad."""
    if "dropped" not in record:
        return record
    if record["fatal"] and on_invalid == "error":
        raise DataError(record["message"])
    return None


def collate_records(
    records: Sequence[dict],
    pad_id: int,
    bucket_lengths: Sequence[int],
    batch_size: int | None = None,
) -> dict[str, np.ndarray]:
    """Stack records into one batch (format in the module docstring), padded to `batch_size` pairs.

    Args:
      records: dicts with `chosen_input_ids` / `rejected_input_ids` (int32 [L]) and `margin`.
      pad_id: the token id written at padded positions.
      bucket_lengths: sorted allowed T; the smallest one holding the longest sequence is used.
      batch_size: B; defaults to len(records). Extra pairs are padding (pair_mask 0).
    """
    size = len(records) if batch_size is None else int(batch_size)
    if len(records) > size:
        raise ValueError(f"{len(records)} records do not fit a batch of {size}")
    longest = max(
        [1] + [len(r[k]) for r in records for k in ("chosen_input_ids", "rejected_input_ids")]
    )
    length = next((b for b in bucket_lengths if b >= longest), None)
    if length is None:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the largest bucket {bucket_lengths[-1]}"
        )
    lengths = np.zeros((size, 2), dtype=np.int32)
    margin = np.zeros((size,), dtype=np.float32)
    pair_mask = np.zeros((size,), dtype=np.float32)
    pieces = []
    for i, record in enumerate(records):
        c, r = record["chosen_input_ids"], record["rejected_input_ids"]
        lengths[i] = (len(c), len(r))
        pieces += (c, r)
        margin[i] = record["margin"]
    pair_mask[: len(records)] = 1.0
    # Whole-batch writes instead of per-sequence slices: the mask's True cells, in row-major order,
    # are exactly the concatenated ids (pair after pair, chosen before rejected).
    real = np.arange(length, dtype=np.int32) < lengths[..., None]
    input_ids = np.full((size, 2, length), pad_id, dtype=np.int32)
    if pieces:
        input_ids[real] = np.concatenate(pieces)
    attention_mask = real.astype(np.int32)
    reward_index = np.maximum(lengths - 1, 0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "reward_index": reward_index,
        "margin": margin,
        "pair_mask": pair_mask,
    }


def _config(
    max_sequence_length: int, truncation_mode: str, data_config: DataConfig | None
) -> DataConfig:
    base = data_config or DataConfig()
    return DataConfig(
        **{
            **base.__dict__,
            "max_sequence_length": max_sequence_length,
            "truncation_mode": truncation_mode,
        }
    )


def create_grain_collect_function(
    tokenizer: Any,
    max_sequence_length: int,
    truncation_mode: str = "keep_end",
    *,
    data_config: DataConfig | None = None,
    dataset_format: str | None = None,
) -> Callable[[dict], dict | None]:
    """Per-record function (for `grain.MapDataset.map`): a raw row -> a record, or None if skipped.

    The record is `{"chosen_input_ids": int32 [Lc], "rejected_input_ids": int32 [Lr], "margin": float,
    "truncated": bool, "index": int}`; `collate_records` (or the TFDS function) stacks records into a
    batch. Rows are checked as `data_config.on_invalid` says (DataError by default).
    """
    config = _config(max_sequence_length, truncation_mode, data_config)
    processor = RowProcessor(tokenizer, config, dataset_format)
    counter = iter(range(1 << 62))

    def collect(row: dict) -> dict | None:
        index = next(counter)
        return raise_or_none(processor.process(row, index, f"row {index}"), config.on_invalid)

    return collect


def create_tfds_collect_function(
    tokenizer: Any,
    max_sequence_length: int,
    truncation_mode: str = "keep_end",
    *,
    data_config: DataConfig | None = None,
    dataset_format: str | None = None,
    batch_size: int | None = None,
) -> Callable[[Sequence[dict]], dict[str, np.ndarray]]:
    """A list of raw rows -> one batch (module docstring), for tf.data or any loader yielding lists.

    Gives the same batch as collating the grain function's records (tested). Skipped rows become
    padding pairs when `batch_size` is set, else the batch is shorter.
    """
    config = _config(max_sequence_length, truncation_mode, data_config)
    processor = RowProcessor(tokenizer, config, dataset_format)
    buckets = default_bucket_lengths(
        config.max_sequence_length, config.bucket_lengths, config.buckets_per_octave
    )
    pad = pad_token_id(tokenizer)

    def collect(rows: Sequence[dict]) -> dict[str, np.ndarray]:
        processed = processor.process_many(
            rows, range(len(rows)), lambda i: f"row {i} of the batch"
        )
        records = [r for p in processed if (r := raise_or_none(p, config.on_invalid)) is not None]
        return collate_records(records, pad, buckets, batch_size or len(rows))

    return collect
