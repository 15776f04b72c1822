"""Packed batch layouts: several pairs per row ("packed") or one prompt per pair ("shared_prompt").

The padded layout (`collate.collate_records`) gives every response its own row of the bucket length.
The layouts here put whole sequences next to each other in rows of length T and tell the model
which token may see which through `segment_ids` (and `branch_ids`); `RewardModel` builds the
block-diagonal causal mask from them, so every reward equals the padded layout's.

Batch format (numpy; R rows of T tokens, P pairs, K = 2P reward slots per row):
  input_ids         int32   [R, T]  pad id outside sequences.
  segment_ids       int32   [R, T]  1, 2, ... per sequence (packed) or per pair (shared_prompt);
                                    0 = padding.
  positions         int32   [R, T]  RoPE positions, restarting at 0 in every segment.
  branch_ids        int32   [R, T]  shared_prompt only: 0 prompt, 1 chosen, 2 rejected response.
                                    A response sees the prompt and itself, never the other one;
                                    the rejected response's positions continue from the prompt's
                                    end, as if it followed the prompt alone.
  reward_positions  int32   [R, K]  index in the row of each reward token; unused slots 0.
  reward_slot       int32   [P, 2]  flat index into R*K of each pair's (chosen, rejected) reward;
                                    0 for padding pairs (read, then masked by pair_mask).
  margin            float32 [P]     as in the padded layout.
  pair_mask         float32 [P]     1 real pair, 0 padding pair.
P is the configured batch size (fixed). T comes from the bucket ladder and R from a ladder of row
counts (`row_ladder`): the (R, T) with the fewest computed tokens R*T that holds the batch
(first-fit decreasing) is used, so the number of distinct shapes, each one XLA compilation,
stays small. Batches are not grouped by length for these layouts (the loader draws pairs at random):
mixed lengths fill rows well, and a batch's token total then varies little, so few (R, T) occur.
Measured on VADER short pairs, batch 8, max length 128 (one epoch, tests/test_packing.py):
padded 0.78 of computed tokens are real (7 shapes, length-grouped), packed 0.91 (7 shapes),
shared_prompt 0.92 (8 shapes).

shared_prompt: the prompt is the common token prefix of chosen and rejected (at most all but the
last token of each, so every response keeps its reward token). The prefix of the *token ids* is
exact whatever the text's prompt boundary was: both responses see the same ids at the same
positions as in their own rows. It saves `prompt_tokens` per pair, so it pays off only when the
shared prefix is long compared with the responses (a 1k-token prompt with short answers: close to
2x fewer tokens; VADER's 10-token instruction before a 30-token sentence: about 15%).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rewardax.data.collate import default_bucket_lengths
from rewardax.data.config import DataConfig, Layout

PACKED_KEYS = (
    "input_ids",
    "segment_ids",
    "positions",
    "reward_positions",
    "reward_slot",
    "margin",
    "pair_mask",
)
SHARED_PROMPT_KEYS = (*PACKED_KEYS, "branch_ids")


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Leading tokens that `a` and `b` share, capped so each keeps at least one token of its own."""
    n = min(len(a), len(b)) - 1
    if n <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


# Up to this row length, a tie in tokens goes to fewer, longer rows (see `choose_shape`).
LONG_ROW_TIES = 512


def row_ladder(max_rows: int, multiple: int = 1, per_octave: int = 2) -> tuple[int, ...]:
    """Allowed row counts R: `per_octave` steps per doubling (1, 2, 3, 4, 6, 8, 12, 16, ...),
    times `multiple` (the data-parallel size: rows are split over devices), up to max_rows."""
    rungs, r = [], 1
    limit = -(-max(int(max_rows), 1) // multiple)
    while True:
        rungs.append(r * multiple)
        if r >= limit:
            return tuple(rungs)
        octave = 1 << (r.bit_length() - 1)
        r += max(octave // per_octave, 1)


def _first_fit(sizes: Sequence[int], order: np.ndarray, length: int) -> list[int] | None:
    """Row of each item (first-fit decreasing into rows of `length`), or None if one is too long."""
    free: list[int] = []
    rows = [0] * len(sizes)
    for i in order:
        size = sizes[i]
        if size > length:
            return None
        for r, room in enumerate(free):
            if room >= size:
                free[r] -= size
                rows[i] = r
                break
        else:
            free.append(length - size)
            rows[i] = len(free) - 1
    return rows


def choose_shape(
    sizes: Sequence[int], lengths: Sequence[int], rows: Sequence[int]
) -> tuple[int, int, list[int]]:
    """(R, T, row of each item): the allowed shape with the fewest tokens R*T that holds `sizes`.

    Ties go to the longer rows while rows are at most `LONG_ROW_TIES` tokens, to the shorter rows
    beyond. Fewer, longer rows hold any later batch at least as well, so one compiled shape serves
    more batches: issue #4's recipe (VADER, rows of 128 or 192) compiles 3 shapes instead of 4,
    its 6 largest batches in 4 x 192 rather than 5 in 6 x 128 and one in 4 x 192, and a compilation
    costs ~3 steps there. Attention's T^2 cost per row is a few percent of a step at these lengths
    and decides past them. `lengths` and `rows` are sorted.
    """
    order = np.argsort(-np.asarray(sizes), kind="stable")
    best = None
    for t in lengths:
        placed = _first_fit(sizes, order, t)
        if placed is None:
            continue
        needed = max(placed, default=-1) + 1
        r = next((r for r in rows if r >= needed), None)
        if r is None:
            continue
        tokens = r * t
        if best is None or tokens < best[0] * best[1]:
            best = (r, t, placed)
        elif tokens == best[0] * best[1] and t <= LONG_ROW_TIES:
            best = (r, t, placed)  # t > best's T: `lengths` is sorted
    if best is None:
        raise ValueError(
            f"{len(sizes)} sequences (longest {max(sizes, default=0)}) do not fit any packed "
            f"shape of at most {rows[-1]} rows x {lengths[-1]} tokens"
        )
    return best


def pack_records(
    records: Sequence[dict],
    pad_id: int,
    *,
    layout: Layout,
    batch_size: int,
    row_lengths: Sequence[int],
    row_multiple: int = 1,
) -> dict[str, np.ndarray]:
    """Records -> one packed batch (module docstring) of `batch_size` pairs.

    Args:
      records: dicts with `chosen_input_ids` / `rejected_input_ids` (int32 [L]) and `margin`.
      pad_id: the token id written at padding positions.
      layout: "packed" (each response its own segment) or "shared_prompt" (one segment per pair:
        the common prompt once, then both responses as branches 1 and 2).
      batch_size: P; extra pairs are padding (pair_mask 0).
      row_lengths: allowed T, sorted (see `packing_row_lengths`).
      row_multiple: R is a multiple of this (the data-parallel size).
    """
    if layout not in ("packed", "shared_prompt"):
        raise ValueError(f"layout must be packed or shared_prompt, got {layout!r}")
    if len(records) > batch_size:
        raise ValueError(f"{len(records)} records do not fit a batch of {batch_size}")
    shared = layout == "shared_prompt"
    # Items: what is placed in a row. packed: one per response; shared_prompt: one per pair.
    items: list[tuple[int, list[tuple[int, np.ndarray, int]]]] = []  # (pair, [(branch, ids, pos0)])
    for p, record in enumerate(records):
        c = np.asarray(record["chosen_input_ids"], np.int32)
        r = np.asarray(record["rejected_input_ids"], np.int32)
        if shared:
            n = common_prefix_length(c, r)
            items.append((p, [(0, c[:n], 0), (1, c[n:], n), (2, r[n:], n)]))
        else:
            items += [(p, [(1, c, 0)]), (p, [(2, r, 0)])]
    sizes = [sum(len(ids) for _, ids, _ in parts) for _, parts in items]
    max_rows = len(items) if items else 1
    num_rows, length, placed = choose_shape(sizes, row_lengths, row_ladder(max_rows, row_multiple))
    slots = 2 * batch_size
    input_ids = np.full((num_rows, length), pad_id, np.int32)
    segment_ids = np.zeros((num_rows, length), np.int32)
    positions = np.zeros((num_rows, length), np.int32)
    branch_ids = np.zeros((num_rows, length), np.int32)
    reward_positions = np.zeros((num_rows, slots), np.int32)
    reward_slot = np.zeros((batch_size, 2), np.int32)
    fill = [0] * num_rows  # next free index per row
    used = [0] * num_rows  # reward slots used per row
    segments = [0] * num_rows
    for (pair, parts), row in zip(items, placed, strict=True):
        segments[row] += 1
        for branch, ids, pos0 in parts:
            start, end = fill[row], fill[row] + len(ids)
            input_ids[row, start:end] = ids
            segment_ids[row, start:end] = segments[row]
            positions[row, start:end] = np.arange(pos0, pos0 + len(ids))
            branch_ids[row, start:end] = branch
            fill[row] = end
            if branch > 0:  # a response: its reward is read at its last token
                reward_positions[row, used[row]] = end - 1
                reward_slot[pair, branch - 1] = row * slots + used[row]
                used[row] += 1
    margin = np.zeros((batch_size,), np.float32)
    pair_mask = np.zeros((batch_size,), np.float32)
    margin[: len(records)] = [float(r["margin"]) for r in records]
    pair_mask[: len(records)] = 1.0
    batch = {
        "input_ids": input_ids,
        "segment_ids": segment_ids,
        "positions": positions,
        "reward_positions": reward_positions,
        "reward_slot": reward_slot,
        "margin": margin,
        "pair_mask": pair_mask,
    }
    if shared:
        batch["branch_ids"] = branch_ids
    return batch


def packing_row_lengths(config: DataConfig) -> tuple[int, ...]:
    """Allowed row lengths T of a packed batch: `data.bucket_lengths` as given (rows longer than
    one sequence hold several: e.g. [192] for 8 VADER pairs makes 3 or 4 rows, two compiled
    shapes), else the bucket ladder up to `max_row_length` (max_sequence_length; twice it for
    shared_prompt, whose rows hold a prompt and two responses)."""
    return default_bucket_lengths(
        config.max_row_length,
        config.bucket_lengths,
        config.buckets_per_octave,
        longer_rows=True,
    )


def token_counts(batch: dict[str, np.ndarray]) -> tuple[int, int]:
    """(real tokens, computed tokens) of a batch of any layout: padding efficiency = real/computed.

    A shared prompt counts once: real tokens are the positions the model computes for a reason.
    """
    mask = batch["segment_ids"] if "segment_ids" in batch else batch["attention_mask"]
    return int(np.count_nonzero(mask)), int(mask.size)
