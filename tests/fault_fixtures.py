"""Helpers for tests/test_faults.py: a tiny workspace, `rewardax train` child processes, polling.

Run as a script this module is a launcher for the CLI with test-only hooks that *pause* the child at
a chosen point and change nothing it computes, so that the test's real SIGKILL/SIGTERM lands there:

    python tests/fault_fixtures.py [--throttle SECONDS] [--hang-in-save STEP --marker FILE] \\
        -- train --config ... (the `rewardax` arguments)

- ``--throttle S`` sleeps S seconds after every logged training step, so a run of a few dozen
  milliseconds-long steps lasts long enough for a signal to land at an arbitrary point of it;
- ``--hang-in-save STEP`` blocks the checkpoint write of STEP after its arrays are written into
  Orbax's temporary directory and before the directory is committed (renamed), after touching
  ``--marker``; the test then kills the process mid-write;
- ``--file-size-limit BYTES`` sets RLIMIT_FSIZE (SIGXFSZ ignored): writes past it fail with EFBIG,
  the way they fail on a full disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "src" / "rewardax" / "configs" / "tiny.yaml"
RX = Path(sys.executable).parent / "rewardax"
TRAIN_ASSET = resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl"
TOTAL_STEPS = 24
SAVE_STEPS = 4
NUM_ROWS = 64  # 16 steps of 4 pairs per epoch: a run of 24 steps crosses an epoch boundary

# Settings of every fault run on top of configs/tiny.yaml: one bucket length (one compilation),
# every checkpoint kept (the tests inspect them), no HTML report.
RUN_SETTINGS = (
    f"--train.max_training_steps={TOTAL_STEPS}",
    f"--checkpoint.save_steps={SAVE_STEPS}",
    "--checkpoint.save_total_limit=null",
    "--data.bucket_lengths=[32]",
)


def build_workspace(tmp: Path) -> dict[str, Path]:
    """A tiny random llama (hidden 32, 2 layers, SmolLM2's 49k vocabulary and tokenizer) saved as a
    Hugging Face directory, and a training file of NUM_ROWS short VADER pairs."""
    from data_fixtures import smollm2_tokenizer, tiny_llama

    tokenizer = smollm2_tokenizer()
    model_dir = tmp / "tiny-model"
    tiny_llama(tokenizer).save_pretrained(model_dir, tokenizer=tokenizer)
    rows = [json.loads(line) for line in Path(TRAIN_ASSET).read_text().splitlines()[:NUM_ROWS]]
    train = tmp / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps(
                {"prompt": "Review:\n", "chosen": r["chosen"][:80], "rejected": r["rejected"][:80]}
            )
            + "\n"
            for r in rows
        )
    )
    return {"tmp": tmp, "model": model_dir, "train": train, "runs": tmp / "runs"}


def child_env(cache_dir: Path) -> dict[str, str]:
    """The child's environment: CPU, and a shared persistent compilation cache (the same XLA
    executable for every run, so each run starts in seconds; results are unaffected)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")]),
    )
    return env


def train_args(work: dict[str, Path], run_name: str, *extra: str) -> list[str]:
    """`rewardax` arguments of a fault run named `run_name` under work["runs"]."""
    return [
        "train",
        "--config",
        str(TINY),
        "--train",
        str(work["train"]),
        "--no-report",
        f"--model.path={work['model']}",
        f"--checkpoint.save_directory={work['runs']}",
        f"--checkpoint.run_name={run_name}",
        *RUN_SETTINGS,
        *extra,
    ]


class Child:
    """A `rewardax` child process whose stdout/stderr go to files (no pipe can fill and block)."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str],
        log_dir: Path,
        *,
        hooks: Sequence[str] = (),
    ):
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{time.monotonic_ns()}"
        self.stdout_path = log_dir / f"{stamp}.out"
        self.stderr_path = log_dir / f"{stamp}.err"
        if hooks:
            command = [sys.executable, str(Path(__file__).resolve()), *hooks, "--", *args]
        else:
            command = [str(RX), *args]
        self.command = command
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, env=env)

    def wait(self, timeout: float = 240) -> int:
        return self.proc.wait(timeout=timeout)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def summary(self) -> dict[str, Any]:
        """The JSON object on the last stdout line."""
        return json.loads(self.stdout.strip().splitlines()[-1])


def run_to_end(args: Sequence[str], env: dict[str, str], log_dir: Path, **kw: Any) -> Child:
    """Runs a child to its end (at most 240 s) and returns it."""
    child = Child(args, env, log_dir, **kw)
    child.wait()
    return child


def wait_until(
    condition: Callable[[], bool], child: Child, timeout: float = 180, what: str = ""
) -> None:
    """Polls `condition` every 5 ms until it holds; fails if the child exits first or on timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if child.proc.poll() is not None:
            raise AssertionError(
                f"the child exited ({child.proc.returncode}) before {what}:\n{child.stderr[-3000:]}"
            )
        if time.monotonic() > deadline:
            child.proc.kill()
            raise AssertionError(f"timed out waiting for {what}:\n{child.stderr[-3000:]}")
        time.sleep(0.005)


def train_steps(run_dir: Path) -> list[int]:
    """The steps of the `train` rows of run_dir/metrics.jsonl, in file order."""
    from rewardax.logging import read_metrics

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [int(r["step"]) for r in read_metrics(path) if r.get("split") == "train"]


def committed_steps(run_dir: Path) -> list[int]:
    """Committed checkpoint steps (plain integer directory names) of a run."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def temporary_dirs(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if "orbax-checkpoint-tmp" in p.name)


def tree_digest(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def exported_tensors(run_dir: Path) -> dict[str, Any]:
    """The exported model's tensors (numpy), read with safetensors (no pickle)."""
    from safetensors.numpy import load_file

    return load_file(str(run_dir / "export" / "model.safetensors"))


def assert_bitwise_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        a, b = got[name], want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), f"tensor {name} differs from the uninterrupted run"


def checkpoint_arrays(step_dir: Path) -> dict[str, Any]:
    """Every array of a checkpoint's `state` item as numpy (restored without a target)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore((step_dir / "state").absolute())
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run directory without its export (a rerun must write its own)."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "export", ignore_errors=True)
    return dst


def progress_steps(stderr: str) -> list[int]:
    """Steps of the `step N/T` progress lines a run printed on stderr."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("step ") and "/" in line:
            out.append(int(line.split()[1].split("/")[0]))
    return out


# ------------------------------------------------------------------------------------- launcher


def _install_hooks(argv: list[str]) -> list[str]:
    """Applies the --throttle / --hang-in-save hooks; returns the CLI arguments after `--`."""
    split = argv.index("--")
    hooks, cli_args = argv[:split], argv[split + 1 :]
    options = dict(zip(hooks[::2], hooks[1::2], strict=True))
    if "--file-size-limit" in options:
        import resource
        import signal

        # As on a full disk: with SIGXFSZ ignored, a write past the limit fails with EFBIG
        # instead of killing the process. Set here rather than in a preexec_fn (fork of a
        # multithreaded JAX test process).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(options["--file-size-limit"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    if "--throttle" in options:
        from rewardax import logging as rlogging

        delay = float(options["--throttle"])
        log = rlogging.MetricsLogger.log

        def slow_log(self, step, metrics, prefix="train"):
            log(self, step, metrics, prefix)
            if prefix == "train":
                time.sleep(delay)

        rlogging.MetricsLogger.log = slow_log
    if "--hang-in-save" in options:
        import orbax.checkpoint as ocp

        hang_step = options["--hang-in-save"]
        marker = Path(options["--marker"])
        finalize = ocp.StandardCheckpointHandler.finalize

        def hanging_finalize(self, directory):
            # `directory` is the state item inside <step>.orbax-checkpoint-tmp-*: written, not
            # yet committed.
            if any(
                p.startswith(f"{hang_step}.orbax-checkpoint-tmp") for p in Path(directory).parts
            ):
                marker.write_text(str(directory))
                time.sleep(600)
            return finalize(self, directory)

        ocp.StandardCheckpointHandler.finalize = hanging_finalize
    return cli_args


if __name__ == "__main__":
    cli_args = _install_hooks(sys.argv[1:])
    from rewardax.cli import main

    sys.exit(main(cli_args))
