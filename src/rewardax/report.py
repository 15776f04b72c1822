"""An HTML evaluation report with PNG plots, from rewards and `preference_metrics` results.

Needs matplotlib (the `report` extra). Figures are drawn on `matplotlib.figure.Figure` objects, which
render with the non-interactive Agg canvas without touching pyplot's global backend, so calling this
from a notebook or a training process changes nothing else.
"""

from __future__ import annotations

import html
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
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
                ax.plot(steps, values, "o-", ms=4, lw=1.6, label=_plain(split))
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
        accuracy = s.metrics["accuracy"]
        ax.set_title(f"{_plain(s.name)}: reward margin per pair (accuracy {accuracy:.3f})")
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
        rho_text = "undefined" if rho is None else f"{rho:.3f}"
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
            label=f"{_plain(s.name)} (ECE {s.metrics['ece']:.3f})",
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


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary_rows(sets: list[_EvalSet]) -> list[list[Any]]:
    def both(s: _EvalSet, key: str) -> str:
        return f"{_fmt(s.metrics.get(key + '_mean'))} ± {_fmt(s.metrics.get(key + '_std'))}"

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
        rows.append(
            [
                "Mean length chosen / rejected",
                *(
                    f"{_fmt(s.metrics.get('chosen_length_mean'))} / "
                    f"{_fmt(s.metrics.get('rejected_length_mean'))}"
                    for s in sets
                ),
            ]
        )
    return rows


def _html(title: str, sets: list[_EvalSet], figures: list[tuple[str, str, str]]) -> str:
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;"
        "padding:0 1em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}"
        "th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right}"
        "th:first-child,td:first-child{text-align:left}thead{background:#f0f0f0}"
        "img{max-width:100%;border:1px solid #ddd}figure{margin:1.5em 0}"
        "figcaption{color:#555;margin-top:.3em}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p>Generated {esc(datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC'))} by rewardax. "
        "A pair is correct when the chosen response gets the higher reward.</p>",
        "<h2>Summary</h2>",
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
                [b["bucket"], b["count"], b["accuracy"], b["mean_length_difference"]]
                for b in s.metrics["length_buckets"]
            ]
            parts.append(_table(["bucket", "pairs", "accuracy", "mean len_c − len_r"], rows))
        if "subsets" in s.metrics:
            parts.append(f"<h3>{esc(s.name)}: accuracy per subset</h3>")
            rows = [[k, v["num_pairs"], v["accuracy"]] for k, v in s.metrics["subsets"].items()]
            parts.append(_table(["subset", "pairs", "accuracy"], rows))
    parts.append("<h2>Plots</h2>")
    for filename, alt, caption in figures:
        parts.append(
            f'<figure><img src="{esc(filename)}" alt="{esc(alt)}">'
            f"<figcaption>{esc(caption)}</figcaption></figure>"
        )
    for s in sets:
        rows = [
            [f"{b['lower']:.3f}–{b['upper']:.3f}", b["count"], b["confidence"], b["accuracy"]]
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

    Writes: index.html, reward_histograms.png, calibration.png, and when their inputs are given,
    training_curves.png and reward_vs_length.png.
    """
    figure_class = _figure_class()
    sets = _eval_sets(metrics, chosen, rejected, chosen_lengths, rejected_lengths)
    series = _training_series(training_metrics) if training_metrics is not None else None
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
        (build / "index.html").write_text(_html(title, sets, figures), encoding="utf-8")
        _move_into_place(build, target)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return target
