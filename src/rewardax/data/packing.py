"""Packed batch layouts: several pairs per row ("packed"), one prompt per pair ("shared_prompt"),
or one prompt per group of K responses (the K-branch layout, `pack_groups`).

The padded layout (`collate.collate_records`) gives every response its own row of the bucket length.
The layouts here put whole sequences next to each other in rows of length T and tell the model
which token may see which through `segment_ids` (and `branch_ids`); `RewardModel` builds the
block-diagonal causal mask from them, so every reward equals the padded layout's.

Batch format (numpy; R rows of T tokens, P pairs, S = 2P reward slots per row):
  input_ids         int32   [R, T]  pad id outside sequences.
  segment_ids       int32   [R, T]  1, 2, ... per sequence (packed) or per pair (shared_prompt);
                                    0 = padding.
  positions         int32   [R, T]  RoPE positions, restarting at 0 in every segment.
  branch_ids        int32   [R, T]  shared_prompt only: 0 prompt, 1 chosen, 2 rejected response.
                                    A response sees the prompt and itself, never the other one;
                                    the rejected response's positions continue from the prompt's
                                    end, as if it followed the prompt alone.
  reward_positions  int32   [R, S]  index in the row of each reward token; unused slots 0.
  reward_slot       int32   [P, 2]  flat index into R*S of each pair's (chosen, rejected) reward;
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

K-branch (`pack_groups`; G groups of up to K responses to one prompt each, S = G*K slots per row):
the shared_prompt tree with K branches. A group is one segment: its prompt (the common token
prefix of all its responses' sequences, each keeping at least its last token) once, then response
k as branch k + 1, positions continuing from the prompt's end. The model's mask rule is the same
(a response sees the prompt and itself, never a sibling), so each reward equals that of the
response encoded alone; shared_prompt is the case K = 2 (branch 1 chosen, 2 rejected). Every
attention implementation takes branch ids: `cpu` and `xla` through `transformer.attention_mask`,
the splash kernel through a mask it builds from them on the device (`models.pallas_attention`).
  input_ids, segment_ids, positions  [R, T] as above (one segment per group).
  branch_ids        int32   [R, T]  0 prompt (and padding), k + 1 response k of its group.
  reward_positions  int32   [R, S]  index in the row of each reward token; unused slots 0.
  reward_slot       int32   [G, K]  flat index into R*S of each response's reward; 0 at padding
                                    slots (read, then masked by response_mask).
  response_mask     float32 [G, K]  1 real response, 0 padding slot (a group with fewer than K
                                    responses, or a padding group).
  row_mask        float32 [G]     1 real group, 0 padding group.
  ranks, scores     float32 [G, K, ...]  the records' per-response arrays, carried as they are
                                    (0 at padding slots); only those the records have.
`steps.rewards_by_slot` turns the model's [R, S, L] output into rewards [G, K, L].
Measured on VADER's train sentences four to a prompt (tests/test_kbranch.py; 320 groups, 8 a
batch, max length 128; sequences of 34.8 tokens, 10.0 of them the shared prefix): the rows hold
0.78x the real tokens of the sequences apart and compute 0.47x the tokens of a padded [G, 4, T]
batch, 0.79x those of packing the sequences without sharing the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
# A K-branch batch's keys (`pack_groups`), besides the per-response arrays it carries.
KBRANCH_KEYS = (
    "input_ids",
    "segment_ids",
    "positions",
    "branch_ids",
    "reward_positions",
    "reward_slot",
    "response_mask",
    "row_mask",
)


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


# A sequence piece placed in a row: (branch id, token ids, RoPE position of its first token).
Part = tuple[int, np.ndarray, int]


def shared_prompt_parts(sequences: Sequence[np.ndarray]) -> list[Part]:
    """One group's tree: the common prompt as branch 0, then sequence k's rest as branch k + 1.

    The prompt is the tokens all `sequences` share at their start, capped so that each keeps at
    least its last token (`common_prefix_length`); every branch's positions continue from the
    prompt's end, so each sequence meets the same ids at the same positions as alone. A single
    sequence shares nothing: it is branch 1 from position 0.

    Example: [5, 6, 7, 2] and [5, 6, 9, 2] -> [(0, [5, 6], 0), (1, [7, 2], 2), (2, [9, 2], 2)].
    """
    seqs = [np.asarray(s, np.int32) for s in sequences]
    n = min((common_prefix_length(seqs[0], s) for s in seqs[1:]), default=0)
    return [(0, seqs[0][:n], 0)] + [(k + 1, s[n:], n) for k, s in enumerate(seqs)]


def _write_rows(
    items: Sequence[tuple[int, list[Part]]],
    pad_id: int,
    *,
    num_groups: int,
    group_size: int,
    row_lengths: Sequence[int],
    row_multiple: int,
) -> dict[str, np.ndarray]:
    """Items (group index, parts) -> the row arrays of a packed batch, first-fit decreasing into
    the smallest allowed (R, T) (`choose_shape`). An item stays whole in one row as one segment;
    each part of branch b > 0 is response b - 1 of its group, rewarded at its last token.

    Returns input_ids, segment_ids, positions, branch_ids [R, T], reward_positions [R, S] with
    S = num_groups * group_size, and reward_slot [num_groups, group_size] (0 where unused).
    """
    sizes = [sum(len(ids) for _, ids, _ in parts) for _, parts in items]
    max_rows = len(items) if items else 1
    num_rows, length, placed = choose_shape(sizes, row_lengths, row_ladder(max_rows, row_multiple))
    slots = num_groups * group_size
    input_ids = np.full((num_rows, length), pad_id, np.int32)
    segment_ids = np.zeros((num_rows, length), np.int32)
    positions = np.zeros((num_rows, length), np.int32)
    branch_ids = np.zeros((num_rows, length), np.int32)
    reward_positions = np.zeros((num_rows, slots), np.int32)
    reward_slot = np.zeros((num_groups, group_size), np.int32)
    fill = [0] * num_rows  # next free index per row
    used = [0] * num_rows  # reward slots used per row
    segments = [0] * num_rows
    for (group, parts), row in zip(items, placed, strict=True):
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
                reward_slot[group, branch - 1] = row * slots + used[row]
                used[row] += 1
    return {
        "input_ids": input_ids,
        "segment_ids": segment_ids,
        "positions": positions,
        "branch_ids": branch_ids,
        "reward_positions": reward_positions,
        "reward_slot": reward_slot,
    }


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
        the common prompt once, then both responses as branches 1 and 2; the K = 2 case of
        `pack_groups`' tree).
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
    items: list[tuple[int, list[Part]]] = []
    for p, record in enumerate(records):
        c = np.asarray(record["chosen_input_ids"], np.int32)
        r = np.asarray(record["rejected_input_ids"], np.int32)
        if shared:
            items.append((p, shared_prompt_parts([c, r])))
        else:
            items += [(p, [(1, c, 0)]), (p, [(2, r, 0)])]
    batch = _write_rows(
        items,
        pad_id,
        num_groups=batch_size,
        group_size=2,
        row_lengths=row_lengths,
        row_multiple=row_multiple,
    )
    if not shared:
        del batch["branch_ids"]
    margin = np.zeros((batch_size,), np.float32)
    pair_mask = np.zeros((batch_size,), np.float32)
    margin[: len(records)] = [float(r["margin"]) for r in records]
    pair_mask[: len(records)] = 1.0
    batch["margin"] = margin
    batch["pair_mask"] = pair_mask
    return batch


def pack_groups(
    records: Sequence[dict],
    pad_id: int,
    *,
    group_size: int,
    batch_size: int,
    row_lengths: Sequence[int],
    row_multiple: int = 1,
    per_response: Sequence[str] = ("ranks", "scores"),
) -> dict[str, np.ndarray]:
    """Records of up to K responses to one prompt -> one K-branch batch (module docstring).

    Each group is one segment: the prompt (the common token prefix of its responses' sequences)
    once as branch 0, then response k as branch k + 1, positions continuing from the prompt's
    end; rows are filled first-fit decreasing as `pack_records` fills them.

    Args:
      records: dicts with `responses_input_ids`, a list of 1..K int arrays [L_k], each the whole
        token sequence of one response (prompt and response, as `chosen_input_ids` is), and,
        optionally, the per-response arrays named in `per_response` ([L_k] or [L_k, ...]).
      pad_id: the token id written at padding positions.
      group_size: K, the batch's responses per group (fixed, as batch_size is).
      batch_size: G, the groups per batch; extra groups are padding (row_mask 0).
      row_lengths: allowed T, sorted; the longest must hold a whole group (`group_row_lengths`).
      row_multiple: R is a multiple of this (the data-parallel size).
      per_response: keys carried through as float32 [G, K, ...] arrays (0 at padding slots). A key
        is carried when the first record has it; every record must then have it.

    Returns:
      dict of numpy arrays; `KBRANCH_KEYS` plus the carried `per_response` keys.

    Example (groups of 3 and 2 responses, K = 3; the first group's prompt is [5], the second's [4])::

        batch = pack_groups(
            [{"responses_input_ids": [[5, 6, 7, 2], [5, 6, 9, 2], [5, 8, 2]], "ranks": [0, 1, 2]},
             {"responses_input_ids": [[4, 3, 2], [4, 9, 2]], "ranks": [1, 0]}],
            pad_id=2, group_size=3, batch_size=2, row_lengths=(16,))
        batch["input_ids"]         # [[5, 6, 7, 2, 6, 9, 2, 8, 2, 4, 3, 2, 9, 2, 2, 2]]
        batch["segment_ids"]       # [[1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0]]
        batch["branch_ids"]        # [[0, 1, 1, 1, 2, 2, 2, 3, 3, 0, 1, 1, 2, 2, 0, 0]]
        batch["positions"]         # [[0, 1, 2, 3, 1, 2, 3, 1, 2, 0, 1, 2, 1, 2, 0, 0]]
        batch["reward_positions"]  # [[3, 6, 8, 11, 13, 0]]
        batch["reward_slot"]       # [[0, 1, 2], [3, 4, 0]]
        batch["response_mask"]     # [[1, 1, 1], [1, 1, 0]]
        batch["ranks"]             # [[0, 1, 2], [1, 0, 0]]
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if len(records) > batch_size:
        raise ValueError(f"{len(records)} groups do not fit a batch of {batch_size}")
    carried = [k for k in per_response if records and k in records[0]]
    response_mask = np.zeros((batch_size, group_size), np.float32)
    arrays: dict[str, np.ndarray] = {}
    items: list[tuple[int, list[Part]]] = []
    for g, record in enumerate(records):
        sequences = record["responses_input_ids"]
        k = len(sequences)
        if not 1 <= k <= group_size:
            raise ValueError(
                f"group {g} has {k} responses; a batch of group_size={group_size} holds 1 to "
                f"{group_size}"
            )
        if any(len(s) == 0 for s in sequences):
            raise ValueError(f"group {g} has an empty response sequence")
        items.append((g, shared_prompt_parts(sequences)))
        response_mask[g, :k] = 1.0
        for key in carried:
            if key not in record:
                raise ValueError(f"group {g} has no `{key}` (the first group has one)")
            value = np.asarray(record[key], np.float32)
            if value.ndim < 1 or len(value) != k:
                raise ValueError(
                    f"group {g}: `{key}` must hold one value per response ({k}), got shape "
                    f"{value.shape}"
                )
            if key not in arrays:
                arrays[key] = np.zeros((batch_size, group_size, *value.shape[1:]), np.float32)
            arrays[key][g, :k] = value
    batch = _write_rows(
        items,
        pad_id,
        num_groups=batch_size,
        group_size=group_size,
        row_lengths=row_lengths,
        row_multiple=row_multiple,
    )
    row_mask = np.zeros((batch_size,), np.float32)
    row_mask[: len(records)] = 1.0
    return {**batch, "response_mask": response_mask, "row_mask": row_mask, **arrays}


# The keys of a packed batch whose first axis is its rows (the others' is its pairs or groups).
ROW_KEYS = ("input_ids", "segment_ids", "positions", "branch_ids", "reward_positions")


def pack_microbatches(
    pack: Callable[[Sequence[dict], Sequence[int]], dict[str, np.ndarray]],
    records: Sequence[dict],
    steps: int,
    row_lengths: Sequence[int],
    pad_id: int,
) -> dict[str, np.ndarray]:
    """One batch of ``steps`` microbatches for gradient accumulation, each packed on its own.

    A packed row holds several pairs (groups), so the rows of one packed batch cannot be split
    into microbatches. Here microbatch m takes records m, m + steps, ...; each is packed by
    ``pack(records, row_lengths)`` (`pack_records` or `pack_groups` with the rest of their
    arguments bound, for ``len(records) // steps`` pairs or groups), then all are given the same
    shape (R, T): T the longest chosen (the others packed again into rows of T), R the most rows
    (the others get padding rows). The result interleaves them, microbatch m in rows m, m + steps,
    ... and in pairs m, m + steps, ..., which is how `steps.make_train_step` splits a batch
    (`_microbatches`). Each microbatch's ``reward_slot`` indexes its own [R, S] rewards, S being
    its pairs' (groups') slots: ``reward_positions.shape[1] * steps`` equals the batch's slots.
    """
    parts = [records[m::steps] for m in range(steps)]
    batches = [pack(part, row_lengths) for part in parts]
    length = max(b["input_ids"].shape[1] for b in batches)
    batches = [
        b if b["input_ids"].shape[1] == length else pack(part, (length,))
        for b, part in zip(batches, parts, strict=True)
    ]
    rows = max(b["input_ids"].shape[0] for b in batches)
    out = {}
    # A microbatch without records (a last, partial batch) carries no per-response keys: zeros.
    for key in dict.fromkeys(k for b in batches for k in b):
        like = next(b[key] for b in batches if key in b)
        arrays = [b[key] if key in b else np.zeros_like(like) for b in batches]
        if key in ROW_KEYS:
            fill = pad_id if key == "input_ids" else 0
            arrays = [
                np.concatenate([a, np.full((rows - len(a), *a.shape[1:]), fill, a.dtype)])
                for a in arrays
            ]
        out[key] = np.stack(arrays, axis=1).reshape(-1, *arrays[0].shape[1:])
    return out


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


def group_row_lengths(config: DataConfig, group_size: int) -> tuple[int, ...]:
    """Allowed row lengths T of a K-branch batch (`pack_groups`): as `packing_row_lengths`, the
    longest reaching `group_size` * max_sequence_length, which holds any group (its prompt once
    and K responses, each sequence at most max_sequence_length)."""
    return default_bucket_lengths(
        config.max_sequence_length * group_size,
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
