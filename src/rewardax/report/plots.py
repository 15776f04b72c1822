"""The report's PNG plots, drawn on `matplotlib.figure.Figure` objects (the Agg canvas, without
touching pyplot's global backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rewardax.errors import ConfigError
from rewardax.report.data import _EvalSet
from rewardax.report.page import format_number

CHOSEN_COLOR = "#1f77b4"
REJECTED_COLOR = "#ff7f0e"
DPI = 100
MAX_SCATTER_POINTS = 4000  # per response kind; keeps the PNG light and the points visible


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError(
            "The HTML report draws its plots with matplotlib, which is not installed; "
            "run `pip install 'rewardax[report]'`."
        ) from error
    return Figure


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
