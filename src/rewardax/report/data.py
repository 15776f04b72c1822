"""The report's inputs checked and lined up: eval sets, training series, before-training
metrics, pair texts, misranked pairs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rewardax.errors import ConfigError, DataError


@dataclass(frozen=True)
class _EvalSet:
    name: str
    metrics: Mapping[str, Any]
    chosen: np.ndarray  # [N]
    rejected: np.ndarray  # [N]
    chosen_lengths: np.ndarray | None  # [N]
    rejected_lengths: np.ndarray | None  # [N]


def _per_set(value: Any, names: Sequence[str], what: str, required: bool) -> dict[str, Any]:
    """Spread an array (one eval set) or a {name: array} mapping over the eval set names."""
    if value is None:
        if required:
            raise ConfigError(f"write_report needs `{what}` rewards.")
        return dict.fromkeys(names)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        missing = [n for n in names if n not in value]
        if unknown or (required and missing):
            raise ConfigError(
                f"`{what}` is keyed by eval set; it has {unknown or 'no'} unknown and "
                f"{missing or 'no'} missing names compared with `metrics` ({list(names)})."
            )
        return {n: value.get(n) for n in names}
    if len(names) != 1:
        raise ConfigError(
            f"`metrics` has {len(names)} eval sets ({list(names)}); pass `{what}` as a dict "
            "keyed by the same names."
        )
    return {names[0]: value}


def _vector(value: Any, what: str, name: str, n: int) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64).reshape(-1)
    if array.shape[0] != n:
        raise DataError(
            f"{what} for eval set {name!r} has {array.shape[0]} values but its metrics count "
            f"{n} pairs; pass the arrays the metrics were computed from."
        )
    return array


def _eval_sets(
    metrics: Mapping[str, Any],
    chosen: Any,
    rejected: Any,
    chosen_lengths: Any,
    rejected_lengths: Any,
) -> list[_EvalSet]:
    # One `preference_metrics` result, or {eval set name: result}.
    named = {"eval": metrics} if "accuracy" in metrics else dict(metrics)
    if not named or not all(isinstance(m, Mapping) and "accuracy" in m for m in named.values()):
        raise ConfigError(
            "`metrics` must be a preference_metrics() result or a dict {eval set name: result}."
        )
    names = list(named)
    spread = [
        _per_set(chosen, names, "chosen", required=True),
        _per_set(rejected, names, "rejected", required=True),
        _per_set(chosen_lengths, names, "chosen_lengths", required=False),
        _per_set(rejected_lengths, names, "rejected_lengths", required=False),
    ]
    sets = []
    for name in names:
        n = int(named[name]["num_pairs"])
        c, r, cl, rl = (s[name] for s in spread)
        if (cl is None) != (rl is None):
            raise ConfigError(
                f"Eval set {name!r}: give both chosen and rejected lengths, or neither."
            )
        sets.append(
            _EvalSet(
                name=str(name),
                metrics=named[name],
                chosen=_vector(c, "chosen", name, n),
                rejected=_vector(r, "rejected", name, n),
                chosen_lengths=None if cl is None else _vector(cl, "chosen_lengths", name, n),
                rejected_lengths=None if rl is None else _vector(rl, "rejected_lengths", name, n),
            )
        )
    return sets


def _training_series(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[tuple]]]:
    """{metric: {split: [(step, value), ...]}} for loss and accuracy, finite values only."""
    series: dict[str, dict[str, list[tuple]]] = {"loss": {}, "accuracy": {}}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "step" not in row or "split" not in row:
            raise DataError(
                f"training_metrics row {i} needs 'step' and 'split' keys (a metrics.jsonl row), "
                f"got {row!r:.200}."
            )
        for metric, by_split in series.items():
            value = row.get(metric)
            if isinstance(value, int | float) and math.isfinite(value):
                by_split.setdefault(str(row["split"]), []).append((row["step"], float(value)))
    return series


def _metrics_before(value: Any, names: Sequence[str]) -> dict[str, Mapping[str, Any]]:
    """{eval set name: preference_metrics result before training}; sets left out have none."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            "`metrics_before` must be a preference_metrics() result or a dict "
            f"{{eval set name: result}}, got {type(value).__name__}."
        )
    if "accuracy" in value:
        if len(names) != 1:
            raise ConfigError(
                f"`metrics` has {len(names)} eval sets ({list(names)}); pass `metrics_before` as "
                "a dict keyed by the same names."
            )
        named = {names[0]: value}
    else:
        named = {str(k): v for k, v in value.items()}
    unknown = sorted(set(named) - set(names))
    if unknown:
        raise ConfigError(
            f"`metrics_before` has eval sets {unknown} that `metrics` lacks ({list(names)})."
        )
    for name, result in named.items():
        if not isinstance(result, Mapping) or "accuracy" not in result:
            raise ConfigError(
                f"`metrics_before[{name!r}]` is not a preference_metrics() result (no 'accuracy')."
            )
    return named


# ------------------------------------------------------------------------------- misranked pairs


def _pair_texts(
    pairs: Mapping[str, Sequence[tuple[str, str]]] | None, sets: list[_EvalSet]
) -> dict[str, Sequence[tuple[str, str]]]:
    """Check `pairs` against the eval sets: {name: texts aligned with that set's rewards}."""
    if pairs is None:
        return {}
    names = [s.name for s in sets]
    if not isinstance(pairs, Mapping):
        raise ConfigError(
            "`pairs` must be a dict {eval set name: [(chosen_text, rejected_text), ...]}, "
            f"got {type(pairs).__name__}."
        )
    unknown = sorted(str(k) for k in pairs if str(k) not in names)
    if unknown:
        raise ConfigError(f"`pairs` has eval sets {unknown} that `metrics` lacks ({names}).")
    texts = {str(k): v for k, v in pairs.items()}
    checked = {}
    for s in sets:
        if s.name not in texts:
            continue
        entries = texts[s.name]
        n = s.chosen.shape[0]
        if len(entries) != n:
            raise DataError(
                f"pairs for eval set {s.name!r} has {len(entries)} entries but its metrics count "
                f"{n} pairs; pass the (chosen, rejected) texts in the order of its rewards."
            )
        for i, pair in enumerate(entries):
            if (
                isinstance(pair, str)
                or not isinstance(pair, Sequence)
                or len(pair) != 2
                or not all(isinstance(t, str) for t in pair)
            ):
                raise DataError(
                    f"pairs for eval set {s.name!r}, entry {i}: expected a (chosen_text, "
                    f"rejected_text) pair of strings, got {pair!r:.200}."
                )
        checked[s.name] = entries
    return checked


def misranked_indices(chosen: np.ndarray, rejected: np.ndarray, limit: int) -> np.ndarray:
    """Indices of at most `limit` pairs with r_c − r_r < 0, most negative first (ties: by index).

    Exact ties (r_c = r_r) are not misranked here: accuracy counts them half right.

    Example:
        >>> misranked_indices(np.array([0.0, 1.0, -2.0, 3.0]), np.array([1.0, 0.0, 0.0, 3.0]), 10)
        array([2, 0])
    """
    margins = np.asarray(chosen, dtype=np.float64) - np.asarray(rejected, dtype=np.float64)
    wrong = np.flatnonzero(margins < 0)
    return wrong[np.argsort(margins[wrong], kind="stable")][:limit]
