"""What every framework runner of the side-by-side benchmark shares (standard library only).

Each runner (`run_rewardax.py`, `run_trl.py`, `run_easydel.py`) runs in its own virtualenv with its
own python, so this module imports nothing outside the standard library. A runner reads a workload
directory written by `workloads.py`, trains the model of `MODEL` on its rows, and writes one JSON
result (see `Result`) that `compare.py` turns into the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The one model every framework trains (issue #7): a small Llama with SmolLM2's tokenizer.
# num_key_value_heads == num_attention_heads (no grouped-query attention); head_dim 64.
MODEL: dict[str, Any] = {
    "architecture": "llama",
    "vocab_size": 49152,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
BATCH_PAIRS = 8  # pairs per optimizer step, every framework
LEARNING_RATE = 1e-5  # AdamW, every framework
SEED = 0


@dataclass
class Result:
    """One framework's run on one workload, as written to the runner's --out file.

    step_times: seconds of every optimizer step in order (warmup steps included; the first
      `warmup` are left out of the summary). real_tokens / computed_tokens: attention-mask ones vs
      tokens the model computed (rows x padded length) over the timed steps' batches, or null when
      the framework's batches could not be seen. compiles: XLA programs built (JAX frameworks) or
      null (eager PyTorch). compile_steps: indices of steps during which XLA compiled a program
      (a new batch shape); the steady-state median leaves them out, `pairs_per_s_all` keeps them.
      compile_seconds: per step, seconds XLA spent compiling in it (backend compile only).
    """

    framework: str
    workload: str
    status: str = "ok"  # ok | unavailable | error
    error: str | None = None
    version: str | None = None
    warmup: int = 0
    pairs_per_step: int = BATCH_PAIRS
    step_times: list[float] = field(default_factory=list)
    real_tokens: int | None = None
    computed_tokens: int | None = None
    compiles: int | None = None
    compile_steps: list[int] = field(default_factory=list)
    compile_seconds: list[float] = field(default_factory=list)
    compile_detail: str | None = None
    notes: list[str] = field(default_factory=list)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Step-time figures of a result dict (see Result).

    median_step_s: median over the timed steps (after warmup) that compiled nothing: the steady
    state of a long run, where each batch shape compiles once. pairs_per_s: pairs per step over that
    median. pairs_per_s_all: pairs over the summed time of every timed step, compiles included
    (what a wall clock sees over a run this short). padding_efficiency: real / computed tokens.
    """
    warmup = result["warmup"]
    timed = result["step_times"][warmup:]
    compiled = {i - warmup for i in result.get("compile_steps", []) if i >= warmup}
    steady = [t for i, t in enumerate(timed) if i not in compiled]
    out: dict[str, Any] = {"timed_steps": len(timed), "timed_compile_steps": len(compiled)}
    if not timed:
        return out
    out["median_is_estimate"] = not steady
    if not steady:
        # Every timed step met a new shape: estimate the step by taking its XLA backend compile
        # seconds off (tracing is not subtracted, so this still overstates the step a little).
        spent = result.get("compile_seconds") or [0.0] * len(result["step_times"])
        steady = [t - c for t, c in zip(timed, spent[warmup:], strict=True)]
    median = statistics.median(steady)
    out["median_step_s"] = median
    out["pairs_per_s"] = result["pairs_per_step"] / median
    out["pairs_per_s_all"] = result["pairs_per_step"] * len(timed) / sum(timed)
    if result.get("computed_tokens"):
        out["padding_efficiency"] = result["real_tokens"] / result["computed_tokens"]
    return out


class CompileCounter:
    """Counts XLA backend compilations (JAX frameworks) through jax.monitoring, with wall times."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        import jax

        self.times: list[float] = []  # time.time() at the end of each compilation
        self.durations: list[float] = []
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if event == self.EVENT:
            self.times.append(time.time())
            self.durations.append(duration)

    def steps_with_compiles(
        self, step_end_times: list[float], start: float
    ) -> tuple[list[int], list[float]]:
        """(indices of steps during which a compilation ended, compile seconds of every step) for
        steps ending at step_end_times (wall clock), the first starting at `start`."""
        steps, seconds, previous = [], [], start
        for i, end in enumerate(step_end_times):
            spent = sum(
                d for t, d in zip(self.times, self.durations, strict=True) if previous < t <= end
            )
            if spent:
                steps.append(i)
            seconds.append(spent)
            previous = end
        return steps, seconds


def runner_args(description: str) -> argparse.Namespace:
    """The command line every runner takes (compare.py builds it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload-dir", required=True, help="a directory from workloads.py")
    parser.add_argument("--tokenizer-dir", required=True, help="SmolLM2 tokenizer, HF layout")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warmup")
    parser.add_argument("--out", required=True, help="result JSON path")
    parser.add_argument("--option", action="append", default=[], help="framework key=value")
    return parser.parse_args()


def read_workload(directory: str | Path, n_pairs: int) -> tuple[dict[str, Any], list[dict]]:
    """(meta, the first n_pairs rows) of a workload directory: rows are {prompt, chosen, rejected}."""
    directory = Path(directory)
    meta = json.loads((directory / "meta.json").read_text())
    rows = []
    with open(directory / "rows.jsonl", encoding="utf-8") as fh:
        for line in fh:
            rows.append(json.loads(line))
            if len(rows) == n_pairs:
                break
    if len(rows) < n_pairs:
        raise SystemExit(
            f"{directory}/rows.jsonl has {len(rows)} rows; {n_pairs} needed "
            "(rebuild the workloads with more rows, or run fewer steps)"
        )
    return meta, rows


class StepClock:
    """Wall time between consecutive step ends; the first step is timed from `start()`."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def start(self) -> None:
        self._last = time.perf_counter()

    def step_done(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def run_guarded(result: Result, out: str | Path, body) -> None:
    """Runs body(result); an exception becomes status=error with its last traceback lines."""
    try:
        body(result)
    except Exception as exc:  # reported in the table, not swallowed: the runner exits 1
        result.status = "error"
        tail = traceback.format_exc().strip().splitlines()[-12:]
        result.error = f"{type(exc).__name__}: {exc}\n" + "\n".join(tail)
        result.write(out)
        print(result.error, file=sys.stderr)
        raise SystemExit(1) from None
    result.write(out)
