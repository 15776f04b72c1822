"""Rows with K ≥ 2 responses, seen as the preference pairs their ranking implies.

Two layouts (decided by the first readable row; every row must then have it):
  - `responses` (K responses: strings, or chat message lists) with `ranks` (K numbers, lower is
    better; equal ranks are ties), and an optional `prompt`;
  - `chosen` and `rejected` as lists of responses (RewardBench 2's layout): every chosen
    response is preferred to every rejected one.

`rankings_as_pairs(source)` presents such a source as one pair row per ordered (better, worse)
couple: a row ranking K responses without ties gives K(K-1)/2 pairs, tied responses give none
between them. The pairs then train and evaluate as any standard or conversational pair (a
Bradley-Terry loss over all the ranking's pairs). Other fields (`prompt`, `subset`, `tools`,
`chat_template_kwargs`, ...) are copied into each pair. Errors name the source row.

Not done here (issue #31): the prompt encoded once for all K responses, and listwise losses
(`rewardax.ranking_losses`) in the train step; a pair row counts once per pair in the loss, so a
row with more responses weighs more.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from rewardax.data.formats import InvalidRow
from rewardax.data.sources import ListSource
from rewardax.errors import DataError
from rewardax.evaluation import spearman_correlation

_RESPONSE_FIELDS = ("responses", "ranks", "chosen", "rejected")


def ranking_layout(row: Any) -> str | None:
    """ "ranks" (`responses` + `ranks`), "lists" (`chosen`/`rejected` lists of responses) or None
    (a pair row, or not a dict)."""
    if not isinstance(row, dict):
        return None
    if "responses" in row or "ranks" in row:
        return "ranks"
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if isinstance(chosen, list) and isinstance(rejected, list):
        # A conversational pair is a list of messages (dicts); a list of responses holds
        # strings or message lists.
        items = [*chosen, *rejected]
        if items and all(isinstance(x, str | list) for x in items):
            return "lists"
    return None


def _response(value: Any, where: str, field: str) -> Any:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return value
    raise DataError(
        f"{where}: every item of `{field}` must be a non-empty string or a list of chat messages, "
        f"got {value!r:.80}"
    )


def row_pairs(row: Any, layout: str, where: str) -> tuple[list[Any], list[tuple[int, int]]]:
    """A K-response row's responses and its (better, worse) index pairs."""
    if ranking_layout(row) != layout:
        raise DataError(
            f"{where}: this dataset's rows list several responses ("
            + ("`responses` + `ranks`" if layout == "ranks" else "`chosen`/`rejected` lists")
            + ", decided by its first row); this row does not"
        )
    if layout == "lists":
        chosen = [_response(x, where, "chosen") for x in row["chosen"]]
        rejected = [_response(x, where, "rejected") for x in row["rejected"]]
        if not chosen or not rejected:
            raise DataError(f"{where}: `chosen` and `rejected` each need at least one response")
        c = len(chosen)
        return chosen + rejected, [(a, c + b) for a in range(c) for b in range(len(rejected))]
    responses, ranks = row.get("responses"), row.get("ranks")
    if not isinstance(responses, list) or len(responses) < 2:
        raise DataError(f"{where}: `responses` must be a list of at least 2 responses")
    if (
        not isinstance(ranks, list)
        or len(ranks) != len(responses)
        or not all(isinstance(r, numbers.Real) and not isinstance(r, bool) for r in ranks)
    ):
        raise DataError(
            f"{where}: `ranks` must be a list of {len(responses)} numbers, one per response "
            f"(lower is better, equal for ties), got {ranks!r:.80}"
        )
    responses = [_response(x, where, "responses") for x in responses]
    k = len(responses)
    pairs = [(a, b) for a in range(k) for b in range(k) if ranks[a] < ranks[b]]
    return responses, pairs


class RankedPairs(ListSource):
    """A random-access source of K-response rows, as the pair rows of their rankings.

    Attributes:
      source: the rows; origin: int [P, 3], each pair's (source row, better, worse) indices.
    """

    def __init__(self, source: Any, layout: str):
        super().__init__((), name=getattr(source, "name", "rows"))
        self.source, self.layout = source, layout
        origin = []
        for i in range(len(source)):
            _, pairs = row_pairs(_read(source, i), layout, source.where(i))
            origin += [(i, a, b) for a, b in pairs]
        self.origin = np.asarray(origin, np.int64).reshape(-1, 3)

    def __len__(self) -> int:
        return len(self.origin)

    def __getitem__(self, index: int) -> dict[str, Any]:
        i, a, b = (int(x) for x in self.origin[int(index)])
        row = _read(self.source, i)
        responses, _ = row_pairs(row, self.layout, self.source.where(i))
        pair = {k: v for k, v in row.items() if k not in _RESPONSE_FIELDS}
        return {**pair, "chosen": responses[a], "rejected": responses[b]}

    def where(self, index: int) -> str:
        i, a, b = (int(x) for x in self.origin[int(index)])
        return f"{self.source.where(i)} (response {a} over {b})"


def response_rewards(
    pairs: RankedPairs, pair_index: np.ndarray, chosen: np.ndarray, rejected: np.ndarray
) -> list[np.ndarray | None]:
    """Each source row's rewards, one per response (``responses`` order; ``chosen`` then
    ``rejected`` for lists), from its scored pairs.

    ``pair_index``, ``chosen``, ``rejected``: the scored pairs (indices into ``pairs``) and their
    rewards. A response in several pairs takes its first reward. A row with a response in no
    scored pair (its pairs were dropped) is None.
    """
    source = pairs.source
    tables: dict[int, np.ndarray] = {}
    for p, c, r in zip(
        np.asarray(pair_index).tolist(), chosen.tolist(), rejected.tolist(), strict=True
    ):
        row, a, b = (int(x) for x in pairs.origin[p])
        if row not in tables:
            responses, _ = row_pairs(_read(source, row), pairs.layout, source.where(row))
            tables[row] = np.full(len(responses), np.nan)
        table = tables[row]
        if np.isnan(table[a]):
            table[a] = c
        if np.isnan(table[b]):
            table[b] = r
    out: list[np.ndarray | None] = [None] * len(source)
    for row, table in tables.items():
        out[row] = None if np.isnan(table).any() else table
    return out


def kendall_tau(x: np.ndarray, y: np.ndarray) -> float | None:
    """Kendall's τ-b of two [K] vectors (ties in either allowed); None when undefined."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    i, j = np.triu_indices(len(x), k=1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    denominator = np.sqrt(np.sum(dx != 0) * np.sum(dy != 0))
    return None if denominator == 0 else float(np.sum(dx * dy) / denominator)


def ranking_metrics(rows: list[Any], rewards: list[np.ndarray | None]) -> dict[str, Any]:
    """How well rewards order each `responses` + `ranks` row: mean Spearman ρ and Kendall τ-b
    between reward and rank (higher reward for a lower rank counts as agreement), and top-1
    accuracy (the highest reward on a best-ranked response; a tie at the top counts 1/k), over
    the rows scored."""
    spearman, kendall, top1 = [], [], []
    for row, reward in zip(rows, rewards, strict=True):
        if reward is None:
            continue
        better = -np.asarray(row["ranks"], np.float64)
        rho, tau = spearman_correlation(reward, better), kendall_tau(reward, better)
        if rho is not None:
            spearman.append(rho)
        if tau is not None:
            kendall.append(tau)
        top = reward == reward.max()
        top1.append(float(np.sum(top & (better == better.max())) / np.sum(top)))
    mean = lambda v: float(np.mean(v)) if v else None  # noqa: E731
    return {
        "spearman": mean(spearman),
        "kendall_tau": mean(kendall),
        "top1_accuracy": mean(top1),
        "num_rows": len(top1),
    }


def _read(source: Any, index: int) -> Any:
    """Row ``index``; one that cannot be read (bad JSON) is a DataError naming it: a ranked
    dataset is checked whole when it is opened."""
    try:
        return source[index]
    except InvalidRow as bad:
        raise DataError(f"{source.where(index)}: {bad}") from None


def has_random_access(source: Any) -> bool:
    """``len(source)`` and ``source[i]`` work (files, lists, datasets; not streams)."""
    return hasattr(source, "__getitem__") and hasattr(source, "__len__")


def rankings_as_pairs(source: Any, probe_rows: int = 16) -> Any:
    """``source`` itself, or a `RankedPairs` view when its first readable row (of the first
    ``probe_rows``) lists several responses. Streams (no random access) are returned as they are;
    unreadable rows are left to the pair pipeline's own errors."""
    if not has_random_access(source):
        return source
    for i in range(min(len(source), probe_rows)):
        try:
            row = source[i]
        except InvalidRow:
            continue
        layout = ranking_layout(row)
        return source if layout is None else RankedPairs(source, layout)
    return source
