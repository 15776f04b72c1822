"""Where training metrics go: ``metrics.jsonl`` always, TensorBoard and W&B on request, a progress line.

``metrics.jsonl`` (in the run directory) has one JSON object per logged step and split::

    {"step": 20, "split": "train", "time": 1718000000.5, "loss": 0.61, "accuracy": 0.75, ...}
    {"step": 20, "split": "eval/heldout", "time": 1718000003.1, "loss": 0.58, ...}

Each line is flushed and fsynced as it is written, so a killed run loses at most the line being
written (a torn last line, which :func:`read_metrics` skips). A resumed run first drops the lines past
its checkpoint step, so the file never repeats or skips a step. Non-finite floats are stored as the
strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON); :func:`read_metrics` turns them back.

Only process 0 writes or prints anything; the other processes' loggers are silent no-ops.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rewardax.errors import ConfigError, DataError

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
REPORT_TARGETS = ("tensorboard", "wandb")
_RESERVED = ("step", "split", "time")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# Shown on the progress line, in this order, when present: (metrics key, label, format).
_PROGRESS_FIELDS = (
    ("loss", "loss", ".4f"),
    ("accuracy", "acc", ".3f"),
    ("pairs_per_second", "pairs/s", ".1f"),
)
# What an evaluation's console line shows (metrics.jsonl keeps every metric).
_EVAL_FIELDS = (
    ("loss", "loss", ".4f"),
    ("accuracy", "acc", ".4f"),
    ("mean_margin", "margin", ".4f"),
    ("ece", "ECE", ".4f"),
    ("spearman", "spearman", ".4f"),  # score rows (`rankings.score_metrics`)
    ("kendall_tau", "kendall", ".4f"),
    ("mse", "mse", ".4f"),
    ("num_pairs", "pairs", "d"),
    ("num_rows", "rows", "d"),
    ("num_truncated", "truncated", "d"),
)


def _encode(value: Any, key: str) -> float | int | str | bool:
    """A JSON-safe scalar for one metric value (numpy/JAX scalars included)."""
    if isinstance(value, bool | int | str):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from exc
    if math.isfinite(number):
        return number
    return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parse_lines(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """(rows, bad line numbers); a torn last line (no newline, or unparsable) is silently dropped."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    # After a final "\n" split() yields an empty string; otherwise the last element was cut short
    # (kept only if it still parses as a whole record: the write died just before its newline).
    torn_tail = lines.pop()
    rows, bad = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and "step" in row:
            rows.append(_decode(row))
        elif number == len(lines) and not torn_tail:
            pass  # a complete-looking but garbled last line: also the mark of a killed write
        else:
            bad.append(number)
    try:
        tail = json.loads(torn_tail) if torn_tail.strip() else None
    except json.JSONDecodeError:
        tail = None
    if isinstance(tail, dict) and "step" in tail:
        rows.append(_decode(tail))
    return rows, bad


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads a ``metrics.jsonl`` (or the run directory holding one) into a list of dicts.

    A torn last line (a run killed mid-write) is skipped; a malformed line elsewhere raises
    :class:`~rewardax.errors.DataError` naming the file and line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise DataError(f"{path} does not exist (no metrics were logged there)")
    rows, bad = _parse_lines(path)
    if bad:
        raise DataError(f"{path}: line {bad[0]} is not a metrics JSON object")
    return rows


class MetricsLogger:
    """Writes metrics to ``metrics.jsonl`` and the requested sinks, and shows progress.

    Args:
        run_dir: the run directory (created if missing).
        report_to: extra sinks: ``"tensorboard"`` (tensorboardX, under ``run_dir/tensorboard``) and/or
            ``"wandb"`` (``WANDB_MODE=offline`` works without a network; ``WANDB_PROJECT`` names the
            project, default ``rewardax``).
        process_index: ``jax.process_index()``; only process 0 writes or prints.
        total_steps: the number of training steps, for the progress bar's ETA (None: unknown).
        progress_bar: a tqdm bar on a terminal; otherwise (or when False) a compact line on stderr
            for each logged training step.
        resume_step: the checkpoint step a resumed run restarts from: lines of ``metrics.jsonl`` with
            a larger step are dropped first (the file is rewritten atomically). None: a fresh run; an
            existing ``metrics.jsonl`` is renamed to ``metrics.jsonl.prev``, not appended to.
        config: a JSON-able dict recorded as the W&B run config.

    Example::

        with MetricsLogger(run_dir, report_to=["tensorboard"], total_steps=80) as logger:
            logger.log(10, {"loss": 0.69, "accuracy": 0.5, "pairs_per_second": 120.0})
            logger.log(10, {"loss": 0.66, "accuracy": 0.6}, prefix="eval/heldout")
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        report_to: Sequence[str] = (),
        process_index: int = 0,
        total_steps: int | None = None,
        progress_bar: bool = True,
        resume_step: int | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(report_to, str):
            report_to = [report_to]
        unknown = [t for t in report_to if t not in REPORT_TARGETS]
        if unknown:
            raise ConfigError(
                f"logging.report_to has unknown target(s) {unknown}; choose from {list(REPORT_TARGETS)}"
            )
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.enabled = process_index == 0
        self.total_steps = total_steps
        self._file: TextIO | None = None
        self._tensorboard: Any = None
        self._wandb_run: Any = None
        self._bar: Any = None
        self._last_progress_step: int | None = None
        self._rate_origin: tuple[int, float] | None = None
        if not self.enabled:
            return
        wandb = _import_wandb() if "wandb" in report_to else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            if self.metrics_path.exists():
                os.replace(self.metrics_path, self.metrics_path.with_name(METRICS_FILE + ".prev"))
        else:
            self._truncate_after(resume_step)
        # Kept open for the whole run and closed in close().
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
        if "tensorboard" in report_to:
            self._tensorboard = _open_tensorboard(self.run_dir / TENSORBOARD_DIR, resume_step)
        if wandb is not None:
            self._wandb_run = _open_wandb(wandb, self.run_dir, resume_step, config)
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=resume_step or 0, unit="step", dynamic_ncols=True
            )

    # ------------------------------------------------------------------------------- metrics
    def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "train") -> None:
        """Records ``metrics`` for ``step`` under split ``prefix`` (``train``, ``eval/<name>``, ...).

        Values are numbers (Python, numpy or 0-d JAX); ``step``, ``split`` and ``time`` are reserved
        keys. A ``train`` record also advances the progress display.
        """
        if not self.enabled:
            return
        clash = [k for k in _RESERVED if k in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in {METRICS_FILE}")
        values = {str(k): _encode(v, str(k)) for k, v in metrics.items()}
        self._write_row(step, prefix, values)
        # Numeric values only for the dashboards (strings other than nan/inf have no scalar plot).
        numbers = {
            k: _NONFINITE[v] if isinstance(v, str) else float(v)
            for k, v in values.items()
            if not isinstance(v, str) or v in _NONFINITE
        }
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(f"{prefix}/{key}", value, int(step))
            self._tensorboard.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({f"{prefix}/{k}": v for k, v in numbers.items()}, step=int(step))
        if prefix == "train":
            self.update(step, numbers)
        else:
            self._write_line(f"step {int(step)} {prefix}: {_format_fields(numbers, _EVAL_FIELDS)}")

    def event(
        self, step: int, split: str, message: str, fields: Mapping[str, Any] | None = None
    ) -> None:
        """Records something that happened to the run at ``step`` (not a metric): ``message`` on
        stderr and one ``metrics.jsonl`` row under ``split`` with ``fields`` (strings or numbers).

        The trainer writes ``{"step": 120, "split": "resume", "run": ..., "checkpoint": ...}`` when
        it resumes. The row has no loss or accuracy, so readers of the curves pass over it, and
        TensorBoard/W&B get nothing (no scalar to plot).
        """
        if not self.enabled:
            return
        fields = dict(fields or {})
        clash = [k for k in _RESERVED if k in fields]
        if clash:
            raise ValueError(f"field names {clash} are reserved in {METRICS_FILE}")
        values = {str(k): _encode(v, str(k)) for k, v in fields.items()}
        self._write_row(step, split, values)
        self._write_line(message)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Advances the progress display to ``step``: step, loss, accuracy, pairs/s and ETA."""
        if not self.enabled:
            return
        step = int(step)
        metrics = metrics or {}
        now = time.monotonic()
        if self._rate_origin is None:
            # The rate counts from the first update, so compilation time does not skew the ETA.
            self._rate_origin = (step, now)
        if self._bar is not None:
            fields = _format_fields(metrics)
            if fields:
                self._bar.set_postfix_str(fields, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
            return
        if self._last_progress_step is not None and step <= self._last_progress_step:
            return
        self._last_progress_step = step
        total = f"/{self.total_steps}" if self.total_steps else ""
        line = f"step {step}{total}"
        fields = _format_fields(metrics)
        if fields:
            line += f" {fields}"
        eta = self._eta(step, now)
        if eta is not None:
            line += f" eta {eta}"
        self._write_line(line)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Writes the end-of-run summary (``summary.json``, atomically) and says where it is."""
        if not self.enabled:
            return
        path = self.run_dir / SUMMARY_FILE
        tmp = path.with_name(SUMMARY_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(_json_safe(values), fh, indent=2, allow_nan=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        if self._wandb_run is not None:
            self._wandb_run.summary.update(_json_safe(values))
        self._write_line(f"run summary: {path}")

    # ------------------------------------------------------------------------------ internals
    def _eta(self, step: int, now: float) -> str | None:
        if not self.total_steps or self._rate_origin is None:
            return None
        first_step, first_time = self._rate_origin
        if step <= first_step or now <= first_time:
            return None
        seconds = (self.total_steps - step) * (now - first_time) / (step - first_step)
        minutes, secs = divmod(int(max(seconds, 0)), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"

    def _write_row(self, step: int, split: str, values: Mapping[str, Any]) -> None:
        """Appends one metrics.jsonl row, flushed and fsynced (see the module docstring)."""
        row = {"step": int(step), "split": split, "time": round(time.time(), 3), **values}
        assert self._file is not None
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def _write_line(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def _truncate_after(self, resume_step: int) -> None:
        """Rewrites metrics.jsonl without the lines past ``resume_step`` (and any torn line)."""
        if not self.metrics_path.exists():
            return
        rows, bad = _parse_lines(self.metrics_path)
        if bad:
            raise DataError(
                f"{self.metrics_path}: line {bad[0]} is not a metrics JSON object; fix or move the "
                "file before resuming"
            )
        kept = [row for row in rows if int(row["step"]) <= resume_step]
        tmp = self.metrics_path.with_name(METRICS_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in kept:
                fh.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.metrics_path)
        _fsync_dir(self.run_dir)

    def close(self) -> None:
        """Flushes and closes every sink (safe to call twice)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _format_fields(metrics: Mapping[str, Any], fields: tuple = _PROGRESS_FIELDS) -> str:
    """``loss 0.6931 acc 0.500 pairs/s 120.0``: the `fields` (key, label, format) present."""
    parts = []
    for key, label, fmt in fields:
        value = metrics.get(key)
        if isinstance(value, int | float):
            parts.append(f"{label} {int(value) if fmt == 'd' else value:{fmt}}")
    return " ".join(parts)


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings and numpy/JAX scalars as Python numbers."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, str | bool | int):
        return value
    if hasattr(value, "tolist"):  # numpy / JAX arrays and scalars
        return _json_safe(value.tolist())
    if isinstance(value, float):
        return _encode(value, "value")
    return str(value)


def _open_tensorboard(directory: Path, resume_step: int | None) -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError as exc:
        raise ConfigError(
            "logging.report_to includes 'tensorboard' but tensorboardX is not installed: "
            "pip install 'rewardax[tensorboard]' (or pip install tensorboardX)"
        ) from exc
    # purge_step makes TensorBoard hide events a killed run wrote past the resumed checkpoint.
    purge = None if resume_step is None else resume_step + 1
    return SummaryWriter(logdir=str(directory), purge_step=purge, flush_secs=10)


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError(
            "logging.report_to includes 'wandb' but wandb is not installed: pip install wandb "
            "(set WANDB_MODE=offline to log without a network)"
        ) from exc
    return wandb


def _open_wandb(
    wandb: Any, run_dir: Path, resume_step: int | None, config: Mapping[str, Any] | None
) -> Any:
    # The run id lives in the run directory so a resumed run continues the same W&B run.
    id_file = run_dir / "wandb_run_id"
    if resume_step is not None and id_file.exists():
        run_id = id_file.read_text().strip()
    else:
        run_id = wandb.util.generate_id()
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "rewardax"),
        name=run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        config=_json_safe(dict(config or {})),
    )
