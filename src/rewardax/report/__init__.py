"""An HTML evaluation report with PNG plots, from rewards and `preference_metrics` results.

The page answers, in this order: what was trained on what (the run), how far training moved the
metrics (before and after), the metrics per eval set, the plots, the pairs the model gets most
wrong, and how to use the exported model. Every number in a table goes through `format_number`.

The package: `data` checks and lines up the inputs, `plots` draws the PNGs, `page` writes the HTML;
`write_report` (here) builds it all in a temporary directory renamed into place.

Needs matplotlib (the `report` extra). Figures are drawn on `matplotlib.figure.Figure` objects, which
render with the non-interactive Agg canvas without touching pyplot's global backend, so calling this
from a notebook or a training process changes nothing else.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rewardax.errors import ConfigError
from rewardax.report.data import (
    _eval_sets,
    _metrics_before,
    _pair_texts,
    _training_series,
    misranked_indices,
)
from rewardax.report.page import (
    RUN_KEYS,
    TEXT_PREVIEW_CHARS,
    _check_run,
    _html,
    _split_shared_start,
    format_number,
)
from rewardax.report.plots import (
    _figure_class,
    _plot_calibration,
    _plot_histograms,
    _plot_length,
    _plot_training,
)


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


__all__ = [
    "RUN_KEYS",
    "TEXT_PREVIEW_CHARS",
    "_plot_training",
    "_split_shared_start",
    "_training_series",
    "format_number",
    "misranked_indices",
    "write_report",
]
