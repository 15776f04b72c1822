"""Which rows go together: per-epoch seeded order, process slices, length-grouped windows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Row order of one epoch (all processes compute the same one): a seeded permutation or 0..n-1."""
    if not shuffle:
        return np.arange(num_rows, dtype=np.int64)
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(num_rows)


def process_rows(num_rows: int, process_index: int, process_count: int) -> int:
    """How many rows of each epoch process `process_index` reads (rows i with i % count == index)."""
    return len(range(process_index, num_rows, process_count))


def window_rows(batch_size: int, length_group_window: int) -> int:
    """Rows sorted together: the window rounded up to whole batches (at least one batch)."""
    window = max(int(length_group_window), 1)
    return max(-(-window // batch_size), 1) * batch_size


def group_by_length(
    records: Sequence[dict], batch_size: int, rng: np.random.Generator | None
) -> list[list[dict]]:
    """Sort a window's records by length and cut them into batches (the last one may be partial).

    Full batches come out in a seeded random order (rng None: shortest first), so a run does not see
    lengths grow steadily within each window. With an rng, the partial batch (which the training
    loader drops at an epoch's end) is drawn at random from the window before sorting; cut from
    the sorted end it would always be the window's longest pairs, a length bias.
    """
    extra = len(records) % batch_size
    rest = list(range(len(records)))
    partial: list[int] = []
    if rng is not None and extra and len(records) > batch_size:
        chosen = set(rng.choice(len(records), size=extra, replace=False).tolist())
        partial = [i for i in rest if i in chosen]
        rest = [i for i in rest if i not in chosen]

    def length(i: int) -> tuple[int, int]:
        r = records[i]
        if "responses" in r:  # a group record (`rewardax.data.groups`)
            return (max(len(x) for x in r["responses"]), i)
        return (max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])), i)

    ordered = [records[i] for i in sorted(rest, key=length)]
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    full = [b for b in batches if len(b) == batch_size]
    tail = [b for b in batches if len(b) < batch_size]
    if partial:
        tail = [[records[i] for i in sorted(partial, key=length)]]
    if rng is not None and len(full) > 1:
        full = [full[i] for i in rng.permutation(len(full))]
    return full + tail
