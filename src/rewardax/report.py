"""An HTML evaluation report with PNG plots, from rewards and `preference_metrics` results.

The page answers, in this order: what was trained on what (the run), how far training moved the
metrics (before and after), the metrics per eval set, the plots, the pairs the model gets most
wrong, and how to use the exported model. Every number in a table goes through `format_number`.

Needs matplotlib (the `report` extra). Figures are drawn on `matplotlib.figure.Figure` objects, which
render with the non-interactive Agg canvas without touching pyplot's global backend, so calling this
from a notebook or a training process changes nothing else.
"""

from __future__ import annotations

import html
import json
import math
import numbers
import os
import shlex
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from rewardax.errors import ConfigError, DataError
from rewardax.evaluation import SIMILAR_LENGTH_FRACTION

CHOSEN_COLOR = "#1f77b4"
REJECTED_COLOR = "#ff7f0e"
DPI = 100
MAX_SCATTER_POINTS = 4000  # per response kind; keeps the PNG light and the points visible
TEXT_PREVIEW_CHARS = 300  # of each text shown for a misranked pair
# Decimals per kind of number (see `format_number`); "count" and "auto" integers have none.
_DECIMALS = {"auto": 4, "score": 4, "count": 4, "seconds": 1, "rate": 1, "length": 1}


@dataclass(frozen=True)
class _EvalSet:
    name: str
    metrics: Mapping[str, Any]
    chosen: np.ndarray  # [N]
    rejected: np.ndarray  # [N]
    chosen_lengths: np.ndarray | None  # [N]
    rejected_lengths: np.ndarray | None  # [N]


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError(
            "The HTML report draws its plots with matplotlib, which is not installed; "
            "run `pip install 'rewardax[report]'`."
        ) from error
    return Figure


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


def _plot_training(figure_class: Any, series: dict, path: Path) -> None:
    fig = figure_class(figsize=(11, 4), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, metric in zip(axes, ("loss", "accuracy"), strict=True):
        splits = sorted(series[metric], key=lambda s: (s != "train", s))
        for split in splits:
            points = sorted(series[metric][split])
            steps = [p[0] for p in points]
            values = np.array([p[1] for p in points])
            if split == "train":
                window = max(1, len(values) // 20)
                ax.plot(steps, values, color="0.6", lw=0.8, alpha=0.6, label="train (per log)")
                if window > 1:
                    smooth = np.convolve(values, np.ones(window) / window, mode="valid")
                    ax.plot(
                        steps[window - 1 :], smooth, color="0.2", lw=1.6, label="train (smoothed)"
                    )
            else:
                # Evaluations are few and far apart: each one gets a marker drawn above the train
                # lines, so three evaluations read as three measurements, not as a line.
                ax.plot(
                    steps,
                    values,
                    "o-",
                    ms=7,
                    mec="white",
                    mew=1.0,
                    lw=1.6,
                    zorder=3,
                    label=f"{_plain(split)} ({len(values)} evaluation{'' if len(values) == 1 else 's'})",
                )
        ax.set_xlabel("training step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if metric == "accuracy":
            ax.axhline(0.5, color="0.5", ls=":", lw=1, label="chance")
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{metric.capitalize()} during training")
        ax.legend(fontsize="small")
    fig.savefig(path)


def _plot_histograms(figure_class: Any, sets: list[_EvalSet], path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    fig = figure_class(figsize=(11, 3.6 * len(sets)), dpi=DPI, layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(sets), 2, squeeze=False))
    for row, s in zip(axes, sets, strict=True):
        low = min(s.chosen.min(), s.rejected.min())
        high = max(s.chosen.max(), s.rejected.max())
        bins = np.linspace(low, high, 41) if high > low else np.linspace(low - 0.5, high + 0.5, 2)
        ax = row[0]
        ax.hist(s.rejected, bins=bins, alpha=0.55, color=REJECTED_COLOR, label="rejected")
        ax.hist(s.chosen, bins=bins, alpha=0.55, color=CHOSEN_COLOR, label="chosen")
        ax.set_title(f"{_plain(s.name)}: rewards, chosen vs rejected")
        ax.set_xlabel("reward")
        ax.set_ylabel("responses")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
        ax = row[1]
        margins = s.chosen - s.rejected
        ax.hist(margins, bins=40 if np.ptp(margins) > 0 else 3, color="0.45")
        ax.axvline(0.0, color="crimson", ls="--", lw=1.2, label="0 (left of it: ranked wrongly)")
        accuracy = format_number(s.metrics["accuracy"], "score")
        ax.set_title(f"{_plain(s.name)}: reward margin per pair (accuracy {accuracy})")
        ax.set_xlabel("r_chosen − r_rejected")
        ax.set_ylabel("pairs")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize="small")
    fig.savefig(path)


def _plot_length(figure_class: Any, sets: list[_EvalSet], path: Path) -> None:
    fig = figure_class(figsize=(6 * len(sets), 4.5), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(sets), squeeze=False)[0]
    rng = np.random.default_rng(0)  # fixed subsample: the same data draws the same picture
    for ax, s in zip(axes, sets, strict=True):
        for label, lengths, rewards, color in (
            ("chosen", s.chosen_lengths, s.chosen, CHOSEN_COLOR),
            ("rejected", s.rejected_lengths, s.rejected, REJECTED_COLOR),
        ):
            keep = np.arange(lengths.size)
            if keep.size > MAX_SCATTER_POINTS:
                keep = rng.choice(keep, MAX_SCATTER_POINTS, replace=False)
            ax.scatter(lengths[keep], rewards[keep], s=10, alpha=0.5, color=color, label=label)
        rho = s.metrics.get("length_spearman")
        rho_text = "undefined" if rho is None else format_number(rho, "score")
        ax.set_title(f"{_plain(s.name)}: reward vs length (Spearman ρ = {rho_text})")
        ax.set_xlabel("response length")
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path)


def _plot_calibration(figure_class: Any, sets: list[_EvalSet], path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    fig = figure_class(figsize=(11, 4.5), dpi=DPI, layout="constrained")
    reliability, counts = fig.subplots(1, 2)
    reliability.plot(
        [0.5, 1.0], [0.5, 1.0], color="0.4", ls="--", lw=1, label="perfectly calibrated"
    )
    for s in sets:
        bins = [b for b in s.metrics["calibration_bins"] if b["count"]]
        x = [b["confidence"] for b in bins]
        y = [b["accuracy"] for b in bins]
        (line,) = reliability.plot(x, y, "-", lw=1.2, alpha=0.7)
        # Marker area grows with the bin's pair count: a point from 3 pairs should look tentative.
        sizes = 15 + 185 * np.array([b["count"] for b in bins]) / max(b["count"] for b in bins)
        reliability.scatter(
            x,
            y,
            s=sizes,
            color=line.get_color(),
            zorder=3,
            label=f"{_plain(s.name)} (ECE {format_number(s.metrics['ece'], 'score')})",
        )
        all_bins = s.metrics["calibration_bins"]
        edges = [b["lower"] for b in all_bins] + [all_bins[-1]["upper"]]
        counts.stairs([b["count"] for b in all_bins], edges, label=_plain(s.name), lw=1.6)
    reliability.set_xlim(0.48, 1.02)
    reliability.set_ylim(-0.02, 1.02)
    reliability.set_xlabel("confidence max(p, 1 − p), p = σ(r_chosen − r_rejected)")
    reliability.set_ylabel("accuracy in bin")
    reliability.set_title("Reliability diagram (marker area ∝ pairs in bin)")
    reliability.text(
        0.98,
        0.03,
        "below the diagonal: overconfident",
        transform=reliability.transAxes,
        ha="right",
        va="bottom",
        color="0.35",
        fontsize="small",
    )
    reliability.grid(alpha=0.3)
    reliability.legend(fontsize="small", loc="upper left", markerscale=0.6)
    counts.set_xlabel("confidence")
    counts.set_ylabel("pairs")
    counts.yaxis.set_major_locator(MaxNLocator(integer=True))
    counts.set_title("How many pairs per confidence bin")
    counts.grid(alpha=0.3)
    counts.legend(fontsize="small")
    fig.savefig(path)


def _plain(text: str) -> str:
    """`text` for a matplotlib label: `$` would otherwise start mathtext."""
    return text.replace("$", r"\$")


def format_number(value: Any, kind: str = "auto") -> str:
    """Write a number the way every table of the report does.

    Args:
        value: a Python or numpy number; None is written "—" and anything else with str().
        kind: "score" for rewards, margins, losses, accuracies, ECE and learning rates; "count" for
            counts; "seconds", "rate" (throughput) and "length" (mean lengths, in tokens or
            characters); "auto" writes integers as counts and other numbers as scores.

    Returns:
        Counts with thousands separators, scores with 4 fixed decimals, seconds, rates and lengths
        with 1; a non-integer with |x| >= 1e6 or 0 < |x| < 1e-4 in `.3e`, whatever its kind (fixed
        decimals would print 1e-5 as 0.0000 and grow a 1e9 into a row of digits).

    Example:
        >>> [format_number(x) for x in (-0.002509, 0.03343, 12345, 1e-5, 0.0)]
        ['-0.0025', '0.0334', '12,345', '1.000e-05', '0.0000']
        >>> format_number(3725.44, "seconds"), format_number(2.0e6, "rate")
        ('3725.4', '2.000e+06')
    """
    if kind not in _DECIMALS:
        raise ValueError(f"format_number: unknown kind {kind!r}; one of {sorted(_DECIMALS)}.")
    if value is None:
        return "—"
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        return str(value)
    integral = isinstance(value, numbers.Integral) or (
        kind == "count" and math.isfinite(value) and float(value).is_integer()
    )
    if integral and kind in ("auto", "count"):
        return f"{int(value):,}"
    x = float(value)
    if not math.isfinite(x):
        return str(x)
    if x == 0.0:
        x = 0.0  # -0.0 would print as "-0.0000"
    elif abs(x) >= 1e6 or abs(x) < 1e-4:
        return f"{x:.3e}"
    return f"{x:.{_DECIMALS[kind]}f}"


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else format_number(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A table of plain values: strings as they are, numbers through `format_number`; all escaped."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary_rows(sets: list[_EvalSet]) -> list[list[Any]]:
    def both(s: _EvalSet, key: str) -> str:
        mean, std = s.metrics.get(key + "_mean"), s.metrics.get(key + "_std")
        return f"{format_number(mean, 'score')} ± {format_number(std, 'score')}"

    def lengths(s: _EvalSet) -> str:
        chosen = format_number(s.metrics.get("chosen_length_mean"), "length")
        rejected = format_number(s.metrics.get("rejected_length_mean"), "length")
        return f"{chosen} / {rejected}"

    num_bins = len(sets[0].metrics.get("calibration_bins", [])) or "?"
    rows = [
        ["Pairs", *(s.metrics.get("num_pairs") for s in sets)],
        ["Accuracy (ties count ½)", *(s.metrics.get("accuracy") for s in sets)],
        ["Loss −log σ(r_c − r_r − margin)", *(s.metrics.get("loss") for s in sets)],
        ["Mean margin r_c − r_r", *(s.metrics.get("mean_margin") for s in sets)],
        [f"ECE ({num_bins} confidence bins over [½, 1])", *(s.metrics.get("ece") for s in sets)],
        ["Brier score", *(s.metrics.get("brier") for s in sets)],
        ["Chosen reward mean ± std", *(both(s, "chosen_reward") for s in sets)],
        ["Rejected reward mean ± std", *(both(s, "rejected_reward") for s in sets)],
        ["All rewards mean ± std", *(both(s, "reward") for s in sets)],
        ["Exact ties", *(s.metrics.get("num_ties") for s in sets)],
    ]
    if any("length_spearman" in s.metrics for s in sets):
        rows.append(
            ["Spearman ρ(reward, length)", *(s.metrics.get("length_spearman") for s in sets)]
        )
        rows.append(["Mean length chosen / rejected", *(lengths(s) for s in sets)])
    return rows


# ------------------------------------------------------------------------------ before and after

_BEFORE_AFTER = (
    ("accuracy", "Accuracy (ties count ½)"),
    ("loss", "Loss"),
    ("mean_margin", "Mean margin r_c − r_r"),
    ("ece", "ECE"),
)


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


def _change(before: Any, after: Any) -> str | None:
    if not isinstance(before, numbers.Real) or not isinstance(after, numbers.Real):
        return None
    difference = float(after) - float(before)
    text = format_number(difference, "score")
    return "+" + text if difference > 0 else text


def _before_after_table(sets: list[_EvalSet], before: Mapping[str, Mapping[str, Any]]) -> str:
    compared = [s for s in sets if s.name in before]
    header = ["metric"]
    for s in compared:
        header += [f"{s.name} before", f"{s.name} after", f"{s.name} change"]
    rows = []
    for key, label in _BEFORE_AFTER:
        row: list[Any] = [label]
        for s in compared:
            b, a = before[s.name].get(key), s.metrics.get(key)
            row += [b, a, _change(b, a)]
        rows.append(row)
    return _table(header, rows)


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


def _shorten(text: str, keep: str) -> str:
    """At most about TEXT_PREVIEW_CHARS characters of `text`: its start, or its end (keep="end")."""
    if len(text) <= TEXT_PREVIEW_CHARS:
        return text
    if keep == "end":
        return "…" + text[-TEXT_PREVIEW_CHARS:].lstrip()
    return text[:TEXT_PREVIEW_CHARS].rstrip() + "…"


def _split_shared_start(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(shared start, rest of chosen, rest of rejected), cut after whitespace so no word splits.

    Both texts of a pair usually begin with the same prompt; showing it once leaves the preview
    room for where the responses differ.
    """
    common = 0
    limit = min(len(chosen), len(rejected))
    while common < limit and chosen[common] == rejected[common]:
        common += 1
    if common < len(chosen) or common < len(rejected):
        while common > 0 and not chosen[common - 1].isspace():
            common -= 1
    return chosen[:common], chosen[common:], rejected[common:]


def _misranked_html(s: _EvalSet, texts: Sequence[tuple[str, str]], limit: int) -> str:
    esc = html.escape
    margins = s.chosen - s.rejected
    wrong = int(np.sum(margins < 0))
    parts = [f"<h3>{esc(s.name)}</h3>"]
    if wrong == 0:
        ties = int(np.sum(margins == 0))
        tie_text = f" ({format_number(ties)} exact ties, counted half right)" if ties else ""
        parts.append(
            f"<p>No misranked pairs: r_chosen − r_rejected ≥ 0 for all "
            f"{format_number(len(margins))} pairs{tie_text}.</p>"
        )
        return "\n".join(parts)
    shown = misranked_indices(s.chosen, s.rejected, limit)
    parts.append(
        f"<p>{format_number(wrong)} of {format_number(len(margins))} pairs have "
        f"r_chosen − r_rejected &lt; 0; the {len(shown)} most negative. “pair” is the position in "
        "this eval set; texts are cut to about "
        f"{TEXT_PREVIEW_CHARS} characters (…), and the start both texts share is shown once.</p>"
    )
    header = ["pair", "margin", "r_chosen", "r_rejected", "shared start", "chosen", "rejected"]
    rows = []
    for i in shown:
        shared, chosen_rest, rejected_rest = _split_shared_start(*texts[i])
        numbers_html = "".join(
            f"<td>{esc(format_number(v))}</td>"
            for v in (int(i), float(margins[i]), float(s.chosen[i]), float(s.rejected[i]))
        )
        texts_html = "".join(
            f'<td class="text">{esc(t)}</td>'
            for t in (
                _shorten(shared, keep="end") if shared else "—",
                _shorten(chosen_rest, keep="start"),
                _shorten(rejected_rest, keep="start"),
            )
        )
        rows.append(f"<tr>{numbers_html}{texts_html}</tr>")
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    parts.append(
        f'<table class="pairs"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------- run


def _escaped(value: Any) -> str:
    return html.escape(str(value))


def _code(value: Any) -> str:
    return f"<code>{html.escape(str(value))}</code>"


def _paths(value: Any) -> str:
    items = [value] if isinstance(value, str | os.PathLike) else list(value)
    return "<br>".join(_code(p) for p in items)


def _named_paths(value: Any) -> str:
    if not isinstance(value, Mapping):
        return _paths(value)
    return "<br>".join(f"{html.escape(str(k))}: {_code(p)}" for k, p in value.items())


def _number(kind: str) -> Callable[[Any], str]:
    return lambda value: html.escape(format_number(value, kind))


def _duration(value: Any) -> str:
    text = format_number(value, "seconds") + " s"
    if isinstance(value, numbers.Real) and math.isfinite(value) and value >= 60:
        minutes, seconds = divmod(round(float(value)), 60)
        hours, minutes = divmod(minutes, 60)
        text += f" ({hours}:{minutes:02d}:{seconds:02d})"
    return html.escape(text)


def _normalization(value: Any) -> str:
    if not isinstance(value, Mapping):
        return _escaped(value)
    mean, std = value.get("mean"), value.get("std")
    stats = html.escape(f"mean {format_number(mean, 'score')}, std {format_number(std, 'score')}")
    return f"{stats} (<code>rewardax score --normalize</code> writes (r − mean) / std)"


# (key, label, renderer to escaped HTML), in the order the Run table shows them.
_RUN_FIELDS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("name", "Run", _escaped),
    ("started", "Started", _escaped),
    ("run_dir", "Run directory", _code),
    ("model", "Model", _code),
    ("train_data", "Training data", _paths),
    ("eval_data", "Eval data", _named_paths),
    ("train_pairs", "Training pairs", _number("count")),
    ("steps", "Steps", _number("count")),
    ("epochs", "Epochs", _number("score")),
    ("batch_size", "Batch size (pairs per step)", _number("count")),
    ("learning_rate", "Learning rate (peak)", _number("score")),
    ("lr_schedule", "Learning-rate schedule", _escaped),
    ("warmup_steps", "Warmup steps", _number("count")),
    ("max_sequence_length", "Max sequence length (tokens)", _number("count")),
    ("layout", "Batch layout", _escaped),
    ("dtype", "Compute dtype", _escaped),
    ("matmul_dtype", "Matmul input dtype", _escaped),
    ("seed", "Seed", _escaped),
    ("wall_time_s", "Wall time", _duration),
    ("train_time_s", "Training time", _duration),
    ("pairs_per_s", "Throughput (pairs/s)", _number("rate")),
    ("tokens_per_s", "Throughput (tokens/s)", _number("rate")),
    ("export_dir", "Exported model", _code),
    ("normalization", "Reward normalization", _normalization),
)
RUN_KEYS = tuple(key for key, _, _ in _RUN_FIELDS)


def _check_run(run: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if run is None:
        return None
    if not isinstance(run, Mapping):
        raise ConfigError(f"`run` must be a dict of run facts, got {type(run).__name__}.")
    unknown = sorted(str(k) for k in run if k not in RUN_KEYS)
    if unknown:
        raise ConfigError(f"`run` has unknown keys {unknown}; the known ones are {list(RUN_KEYS)}.")
    return run


def _run_table(run: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(label)}</th><td>{render(run[key])}</td></tr>"
        for key, label, render in _RUN_FIELDS
        if run.get(key) is not None
    )
    return f'<table class="facts"><tbody>{rows}</tbody></table>'


def _headline(
    run: Mapping[str, Any] | None,
    sets: list[_EvalSet],
    before: Mapping[str, Mapping[str, Any]],
) -> str:
    """One sentence: which model, how long, and what accuracy it reached (from what)."""
    facts = []
    if run is not None and run.get("model") is not None:
        facts.append(f"Model {Path(str(run['model'])).name}")
    if run is not None and run.get("steps") is not None:
        pairs = run.get("train_pairs")
        on = f" on {format_number(pairs, 'count')} training pairs" if pairs is not None else ""
        facts.append(f"trained {format_number(run['steps'], 'count')} steps{on}")
    accuracies = []
    for s in sets:
        after = format_number(s.metrics.get("accuracy"), "score")
        if s.name in before:
            was = format_number(before[s.name].get("accuracy"), "score")
            accuracies.append(f"{s.name} {was} → {after}")
        else:
            accuracies.append(f"{s.name} {after}")
    sentence = ", ".join(facts)
    sentence = (sentence + ". " if sentence else "") + "Accuracy: " + "; ".join(accuracies) + "."
    return html.escape(sentence)


def _usage_html(export_dir: Any, normalization: Any) -> str:
    esc = html.escape
    path = str(export_dir)
    shell_path = shlex.quote(path)
    normalize = ""
    if isinstance(normalization, Mapping):
        normalize = (
            "\n# rewardax score --normalize writes (reward - mean) / std, with the stored "
            f"mean {format_number(normalization.get('mean'), 'score')}, "
            f"std {format_number(normalization.get('std'), 'score')}"
        )
    python = (
        "import torch\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n\n"
        f"path = {json.dumps(path, ensure_ascii=False)}\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)\n"
        "model = AutoModelForSequenceClassification.from_pretrained(path).eval()\n"
        "# Training appended EOS to plain-text responses (data.append_eos), so append it here too.\n"
        'text = "Q: Is it good? A: Yes, very." + tokenizer.eos_token\n'
        "with torch.no_grad():\n"
        '    reward = model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()'
        f"{normalize}\n"
    )
    return "\n".join(
        [
            '<h2 id="usage">Using the model</h2>',
            f"<p>The exported model is a Hugging Face directory: {_code(path)}</p>",
            "<p>Score responses, one row each (<code>messages</code>, <code>prompt</code> + "
            "<code>response</code>, or <code>text</code>; tokenized as in training); every row "
            "comes back with a <code>reward</code>:</p>",
            f"<pre><code>rewardax score --model {esc(shell_path)} --input rows.jsonl "
            "--output scored.jsonl</code></pre>",
            "<p>Measure it on other preference pairs (add <code>--report DIR</code> for a page "
            "like this one):</p>",
            f"<pre><code>rewardax eval --model {esc(shell_path)} --data pairs.jsonl</code></pre>",
            "<p>With <code>transformers</code>: the reward is the single logit.</p>",
            f"<pre><code>{esc(python)}</code></pre>",
        ]
    )


# ------------------------------------------------------------------------------------------ page

_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;"
    "color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}"
    "th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right;vertical-align:top}"
    "th:first-child,td:first-child{text-align:left}thead{background:#f0f0f0}"
    "table.facts th{background:#f0f0f0;font-weight:600}table.facts td{text-align:left}"
    "td.text{text-align:left;white-space:pre-wrap;overflow-wrap:anywhere;font-size:.85em;"
    "min-width:12em}code,pre{font-family:ui-monospace,monospace;font-size:.9em}"
    "pre{background:#f6f6f6;border:1px solid #ddd;padding:.6em .8em;overflow-x:auto}"
    "img{max-width:100%;border:1px solid #ddd}figure{margin:1.5em 0}"
    "figcaption{color:#555;margin-top:.3em}nav{color:#555}nav a{margin-right:.8em}"
)


def _html(
    title: str,
    sets: list[_EvalSet],
    figures: list[tuple[str, str, str]],
    *,
    run: Mapping[str, Any] | None = None,
    before: Mapping[str, Mapping[str, Any]] | None = None,
    texts: Mapping[str, Sequence[tuple[str, str]]] | None = None,
    num_misranked: int = 10,
) -> str:
    esc = html.escape
    before = before or {}
    texts = texts or {}
    export_dir = run.get("export_dir") if run is not None else None
    sections = [("summary", "Summary"), ("plots", "Plots")]
    if run is not None:
        sections.insert(0, ("run", "Run"))
    if before:
        sections.insert(-2, ("before-after", "Before and after training"))
    if texts:
        sections.append(("misranked", "Misranked pairs"))
    if export_dir is not None:
        sections.append(("usage", "Using the model"))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p><strong>{_headline(run, sets, before)}</strong></p>",
        f"<p>Generated {esc(datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC'))} by rewardax. "
        "A pair is correct when the chosen response gets the higher reward.</p>",
        "<nav>" + "".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in sections) + "</nav>",
    ]
    if run is not None:
        parts += ['<h2 id="run">Run</h2>', _run_table(run)]
    if before:
        parts += [
            '<h2 id="before-after">Before and after training</h2>',
            _before_after_table(sets, before),
        ]
    parts += [
        '<h2 id="summary">Summary</h2>',
        _table(["metric", *(s.name for s in sets)], _summary_rows(sets)),
    ]
    for s in sets:
        if "length_buckets" in s.metrics:
            parts.append(f"<h3>{esc(s.name)}: accuracy by length difference</h3>")
            parts.append(
                f"<p>similar_length: |len_chosen − len_rejected| ≤ {SIMILAR_LENGTH_FRACTION:.0%} of the "
                "longer response.</p>"
            )
            rows = [
                [
                    b["bucket"],
                    b["count"],
                    b["accuracy"],
                    format_number(b["mean_length_difference"], "length"),
                ]
                for b in s.metrics["length_buckets"]
            ]
            parts.append(_table(["bucket", "pairs", "accuracy", "mean len_c − len_r"], rows))
        if "subsets" in s.metrics:
            parts.append(f"<h3>{esc(s.name)}: accuracy per subset</h3>")
            rows = [[k, v["num_pairs"], v["accuracy"]] for k, v in s.metrics["subsets"].items()]
            parts.append(_table(["subset", "pairs", "accuracy"], rows))
    parts.append('<h2 id="plots">Plots</h2>')
    for filename, alt, caption in figures:
        parts.append(
            f'<figure><img src="{esc(filename)}" alt="{esc(alt)}">'
            f"<figcaption>{esc(caption)}</figcaption></figure>"
        )
    if texts:
        parts.append('<h2 id="misranked">Misranked pairs with the largest wrong margins</h2>')
        parts += [_misranked_html(s, texts[s.name], num_misranked) for s in sets if s.name in texts]
    if export_dir is not None:
        parts.append(_usage_html(export_dir, run.get("normalization")))
    for s in sets:
        rows = [
            [
                f"{format_number(b['lower'], 'score')}–{format_number(b['upper'], 'score')}",
                b["count"],
                b["confidence"],
                b["accuracy"],
            ]
            for b in s.metrics.get("calibration_bins", [])
        ]
        parts.append(f"<details><summary>{esc(s.name)}: calibration bins</summary>")
        parts.append(_table(["confidence bin", "pairs", "mean confidence", "accuracy"], rows))
        parts.append("</details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _move_into_place(built: Path, target: Path) -> None:
    """Rename `built` to `target`, replacing an existing `target` only once `built` is complete."""
    if not target.exists():
        built.rename(target)
        return
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    target.rename(old)
    try:
        built.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old)


def write_report(
    report_dir: str | os.PathLike[str],
    *,
    metrics: Mapping[str, Any],
    chosen: Any,
    rejected: Any,
    chosen_lengths: Any = None,
    rejected_lengths: Any = None,
    training_metrics: Sequence[Mapping[str, Any]] | None = None,
    title: str = "rewardax evaluation",
    overwrite: bool = False,
    run: Mapping[str, Any] | None = None,
    metrics_before: Mapping[str, Any] | None = None,
    pairs: Mapping[str, Sequence[tuple[str, str]]] | None = None,
    num_misranked: int = 10,
) -> Path:
    """Write `report_dir/index.html` and its PNG plots; return the report directory.

    Args:
        report_dir: directory to create. An existing non-empty one is replaced only with
            overwrite=True. The report is built in a hidden temporary directory next to it and
            renamed into place at the end, so a failure never leaves half a report.
        metrics: a `preference_metrics` result (one eval set, named "eval"), or a dict
            {eval set name: result}.
        chosen, rejected: [N] rewards of that eval set, or dicts {eval set name: [N] array}.
        chosen_lengths, rejected_lengths: optional [N] lengths, same layout; enable the reward vs
            length plot.
        training_metrics: optional metrics.jsonl rows {"step", "split": "train" | "eval/<name>",
            "loss", "accuracy", ...}; enable the training curves.
        title: page title (escaped).
        overwrite: replace a non-empty `report_dir`.
        run: optional facts about the training run, shown as the "Run" table in this order (keys
            left out or None are skipped; an unknown key is an error): name, started (ISO time),
            run_dir, model (path), train_data (list of paths), eval_data ({name: path}),
            train_pairs, steps, epochs, batch_size (pairs per step), learning_rate, lr_schedule,
            warmup_steps, max_sequence_length, layout, dtype, matmul_dtype, seed, wall_time_s,
            train_time_s, pairs_per_s, tokens_per_s, export_dir, normalization ({"mean", "std"}).
            With export_dir, a "Using the model" section gives `rewardax score`, `rewardax eval`
            and `transformers` commands for it.
        metrics_before: optional metrics measured before training, same layout as `metrics`
            (eval sets may be left out); adds a "Before and after training" table of accuracy,
            loss, mean margin and ECE.
        pairs: optional {eval set name: [(chosen_text, rejected_text), ...]}, aligned with that
            set's `chosen`/`rejected`; adds, per set given, the `num_misranked` pairs with the most
            negative r_chosen − r_rejected and their texts.
        num_misranked: how many misranked pairs to list per eval set.

    Writes: index.html, reward_histograms.png, calibration.png, and when their inputs are given,
    training_curves.png and reward_vs_length.png.
    """
    figure_class = _figure_class()
    sets = _eval_sets(metrics, chosen, rejected, chosen_lengths, rejected_lengths)
    series = _training_series(training_metrics) if training_metrics is not None else None
    run = _check_run(run)
    before = _metrics_before(metrics_before, [s.name for s in sets])
    texts = _pair_texts(pairs, sets)
    if isinstance(num_misranked, bool) or not isinstance(num_misranked, int) or num_misranked < 1:
        raise ConfigError(f"num_misranked must be a positive integer, got {num_misranked!r}.")
    target = Path(report_dir).resolve()
    if target.exists():
        if not target.is_dir():
            raise ConfigError(f"Report path {target} exists and is not a directory.")
        if any(target.iterdir()) and not overwrite:
            raise ConfigError(
                f"Report directory {target} is not empty; choose another path or pass overwrite=True."
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build.chmod(0o755)  # mkdtemp makes it owner-only; a report is meant to be shared
        figures = []
        if series is not None and any(series[m] for m in series):
            _plot_training(figure_class, series, build / "training_curves.png")
            figures.append(
                (
                    "training_curves.png",
                    "loss and accuracy vs training step",
                    "Loss and accuracy during training: train (per logged step) and each eval set.",
                )
            )
        _plot_histograms(figure_class, sets, build / "reward_histograms.png")
        figures.append(
            (
                "reward_histograms.png",
                "histograms of chosen and rejected rewards, and of the margin",
                "Left: rewards of chosen and rejected responses; the less they overlap, the better. "
                "Right: per-pair margin; pairs left of the red line are ranked wrongly.",
            )
        )
        with_lengths = [s for s in sets if s.chosen_lengths is not None]
        if with_lengths:
            _plot_length(figure_class, with_lengths, build / "reward_vs_length.png")
            figures.append(
                (
                    "reward_vs_length.png",
                    "reward vs response length",
                    "Reward against response length: a strong trend means the model rewards "
                    "length itself.",
                )
            )
        _plot_calibration(figure_class, sets, build / "calibration.png")
        figures.append(
            (
                "calibration.png",
                "calibration curve",
                "Calibration of σ(r_chosen − r_rejected) as the probability that chosen wins: "
                "points on the diagonal mean the stated confidence matches the accuracy.",
            )
        )
        page = _html(
            title,
            sets,
            figures,
            run=run,
            before=before,
            texts=texts,
            num_misranked=num_misranked,
        )
        (build / "index.html").write_text(page, encoding="utf-8")
        _move_into_place(build, target)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return target
