"""Nothing lost under faults (issue #8, items 1-6): real `rewardax train` processes, real signals.

Every run is the console script (or tests/fault_fixtures.py as a launcher whose hooks only pause the
child so a signal lands at a chosen point) on a tiny random llama with SmolLM2's tokenizer: 24 steps
of 4 pairs, a checkpoint every 4 steps, an epoch boundary at step 16. An uninterrupted run is the
reference; every interrupted-and-rerun run must end with the same exported parameters, bit for bit,
and a metrics.jsonl holding each training step exactly once.
"""

from __future__ import annotations

import random
import signal

import numpy as np
import pytest

from fault_fixtures import (
    SAVE_STEPS,
    TOTAL_STEPS,
    Child,
    assert_bitwise_equal,
    build_workspace,
    checkpoint_arrays,
    child_env,
    committed_steps,
    copy_run,
    exported_tensors,
    largest_file,
    progress_steps,
    run_to_end,
    temporary_dirs,
    train_args,
    train_steps,
    tree_digest,
    wait_until,
)

# Left out of `make test`, run by `make test-slow`: kills, signals and fills the disk under real training processes.
pytestmark = pytest.mark.slow

ALL_STEPS = list(range(1, TOTAL_STEPS + 1))
THROTTLE = ["--throttle", "0.05"]  # 24 steps then take >= 1.2 s: a signal lands mid-run


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = build_workspace(tmp_path_factory.mktemp("faults"))
    work["env"] = child_env(work["tmp"] / "jax-cache")
    work["logs"] = work["tmp"] / "logs"
    return work


@pytest.fixture(scope="module")
def baseline(work):
    """The uninterrupted reference run."""
    child = run_to_end(train_args(work, "baseline"), work["env"], work["logs"])
    assert child.proc.returncode == 0, child.stderr[-3000:]
    run = work["runs"] / "baseline"
    assert committed_steps(run) == list(range(SAVE_STEPS, TOTAL_STEPS + 1, SAVE_STEPS))
    assert train_steps(run) == ALL_STEPS
    return {"run": run, "tensors": exported_tensors(run)}


def error_line(stderr: str) -> str:
    """The one `rewardax: error:` line (Orbax may print noise after it at interpreter exit)."""
    lines = [line for line in stderr.splitlines() if line.startswith("rewardax: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def rerun(work, name, *extra):
    child = run_to_end(train_args(work, name, *extra), work["env"], work["logs"])
    assert child.proc.returncode == 0, child.stderr[-3000:]
    return child


def assert_same_result_as_baseline(work, baseline, name):
    run = work["runs"] / name
    assert_bitwise_equal(exported_tensors(run), baseline["tensors"])
    assert train_steps(run) == ALL_STEPS, "metrics.jsonl repeats or misses a training step"
    return run


def test_sigkill_at_a_random_step_then_rerun_is_bitwise_identical(work, baseline):
    kill_after = random.Random().randint(SAVE_STEPS + 1, TOTAL_STEPS - 3)
    run = work["runs"] / "sigkill"
    child = Child(train_args(work, "sigkill"), work["env"], work["logs"], hooks=THROTTLE)
    wait_until(
        lambda: committed_steps(run) and len(train_steps(run)) >= kill_after,
        child,
        what=f"step {kill_after}",
    )
    child.signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    saved = committed_steps(run)
    assert saved and saved[-1] < TOTAL_STEPS, (kill_after, saved)

    again = rerun(work, "sigkill")
    # It resumed at the newest checkpoint, not from scratch.
    assert progress_steps(again.stderr)[0] == saved[-1] + 1, (kill_after, saved)
    assert_same_result_as_baseline(work, baseline, "sigkill")


def test_sigterm_saves_the_current_step_exits_0_and_the_rerun_continues(work, baseline):
    stop_after = random.Random().randint(SAVE_STEPS + 1, TOTAL_STEPS - 3)
    run = work["runs"] / "sigterm"
    child = Child(train_args(work, "sigterm"), work["env"], work["logs"], hooks=THROTTLE)
    wait_until(lambda: len(train_steps(run)) >= stop_after, child, what=f"step {stop_after}")
    child.signal(signal.SIGTERM)
    assert child.wait() == 0, child.stderr[-3000:]
    summary = child.summary()
    assert summary["stopped_early"] is True and summary["export_dir"] is None
    stopped_at = train_steps(run)[-1]
    assert stop_after <= stopped_at < TOTAL_STEPS
    # The step in flight finished and was saved, whether or not it is a save_steps multiple.
    assert committed_steps(run)[-1] == stopped_at
    assert not (run / "export").exists()

    again = rerun(work, "sigterm")
    assert progress_steps(again.stderr)[0] == stopped_at + 1
    assert_same_result_as_baseline(work, baseline, "sigterm")


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(work, baseline):
    run = work["runs"] / "killsave"
    marker = work["tmp"] / "killsave.marker"
    hang = ["--hang-in-save", str(2 * SAVE_STEPS), "--marker", str(marker)]
    child = Child(train_args(work, "killsave"), work["env"], work["logs"], hooks=hang)
    wait_until(marker.exists, child, what=f"the write of checkpoint {2 * SAVE_STEPS}")
    assert temporary_dirs(run), "the checkpoint being written should be a temporary directory"
    before = tree_digest(run / "checkpoints" / str(SAVE_STEPS))
    child.signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert committed_steps(run) == [SAVE_STEPS]

    again = rerun(work, "killsave")
    assert progress_steps(again.stderr)[0] == SAVE_STEPS + 1
    assert temporary_dirs(run) == []  # the interrupted write was cleaned up
    assert tree_digest(run / "checkpoints" / str(SAVE_STEPS)) == before  # untouched
    assert_same_result_as_baseline(work, baseline, "killsave")


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_with_a_warning(work, baseline):
    run = copy_run(baseline["run"], work["runs"] / "corrupt")
    bad = run / "checkpoints" / str(TOTAL_STEPS)
    victim = largest_file(bad / "state")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])

    again = rerun(work, "corrupt")
    assert "CorruptCheckpointWarning" in again.stderr
    warning = next(line for line in again.stderr.splitlines() if "cannot be loaded" in line)
    assert str(bad) in warning
    assert progress_steps(again.stderr)[0] == TOTAL_STEPS - SAVE_STEPS + 1
    # The unloadable checkpoint was moved aside (kept for inspection), then written afresh.
    assert [p.name for p in (run / "checkpoints").glob(f"{TOTAL_STEPS}.corrupt-*")]
    assert_same_result_as_baseline(work, baseline, "corrupt")


def test_no_valid_checkpoint_is_a_clear_error_not_a_fresh_start(work, baseline):
    run = copy_run(baseline["run"], work["runs"] / "allbad")
    for step in committed_steps(run):
        victim = largest_file(run / "checkpoints" / str(step) / "state")
        victim.write_bytes(b"")
    metrics_before = (run / "metrics.jsonl").read_bytes()
    digest_before = tree_digest(run / "checkpoints")

    child = run_to_end(train_args(work, "allbad"), work["env"], work["logs"])
    assert child.proc.returncode == 2
    last = error_line(child.stderr)
    assert last.startswith("rewardax: error: none of the checkpoints under")
    assert "refusing to start from scratch" in last
    # Orbax's abandoned reads once printed ~5,000 lines of reports around (and into) that line.
    assert "Exception ignored" not in child.stderr
    assert "Event loop is closed" not in child.stderr
    for step in range(SAVE_STEPS, TOTAL_STEPS + 1, SAVE_STEPS):
        assert str(run / "checkpoints" / str(step)) in last
    # Nothing was trained, logged, deleted or exported.
    assert progress_steps(child.stderr) == []
    assert (run / "metrics.jsonl").read_bytes() == metrics_before
    assert tree_digest(run / "checkpoints") == digest_before
    assert not (run / "export").exists()


FILE_SIZE_LIMIT = 5 * 2**20  # above tokenizer.json (3.4 MiB), below one checkpoint file (~6 MiB)


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_says_why(work, baseline):
    run = copy_run(baseline["run"], work["runs"] / "diskfull")
    for step in committed_steps(run)[1:]:
        for path in sorted((run / "checkpoints" / str(step)).rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (run / "checkpoints" / str(step)).rmdir()
    assert committed_steps(run) == [SAVE_STEPS]
    before = tree_digest(run / "checkpoints" / str(SAVE_STEPS))

    limit = ["--file-size-limit", str(FILE_SIZE_LIMIT)]
    child = run_to_end(train_args(work, "diskfull"), work["env"], work["logs"], hooks=limit)
    assert child.proc.returncode == 2, child.stderr[-3000:]
    last = error_line(child.stderr)
    assert last.startswith(f"rewardax: error: saving checkpoint step {2 * SAVE_STEPS}")
    assert "a file-size limit (ulimit -f) was hit" in last
    assert f"the earlier checkpoints [{SAVE_STEPS}] are intact" in last
    assert committed_steps(run) == [SAVE_STEPS] and temporary_dirs(run) == []
    assert tree_digest(run / "checkpoints" / str(SAVE_STEPS)) == before

    # The survivor is good: with space again the run resumes from it and ends as the reference.
    again = rerun(work, "diskfull")
    assert progress_steps(again.stderr)[0] == SAVE_STEPS + 1
    assert_same_result_as_baseline(work, baseline, "diskfull")


# An absurd step: SGD at 1e30 with no clipping and no warmup; the first update makes the weights
# ~1e28 and the next forward pass overflows float32.
EXPLODE = (
    "--optim.name=sgd",
    "--optim.learning_rate=1e30",
    "--optim.max_grad_norm=null",
    "--optim.schedule=constant",
    "--optim.warmup_steps=0",
    "--checkpoint.save_steps=1",
)


def test_nan_policy_error_stops_naming_the_step_and_keeps_only_clean_checkpoints(work):
    run = work["runs"] / "nan-error"
    child = run_to_end(train_args(work, "nan-error", *EXPLODE), work["env"], work["logs"])
    assert child.proc.returncode == 2
    last = error_line(child.stderr)
    assert last.startswith("rewardax: error: step ")
    bad_step = int(last.split("step ")[1].split(":")[0])
    assert "NaN/Inf" in last and "nan_policy=skip_step" in last
    saved = committed_steps(run)
    assert saved == list(range(1, bad_step)), (bad_step, saved)
    assert f"step {saved[-1]} in " in last  # names the intact checkpoint
    for step in saved:
        arrays = checkpoint_arrays(run / "checkpoints" / str(step))
        for name, array in arrays.items():
            if np.issubdtype(array.dtype, np.floating):
                assert np.isfinite(array).all(), f"checkpoint {step}: {name} is not finite"
    assert train_steps(run) == list(range(1, bad_step))  # the bad step was never logged
    assert not (run / "export").exists()


def test_nan_policy_skip_step_skips_and_counts(work):
    run = work["runs"] / "nan-skip"
    child = run_to_end(
        train_args(work, "nan-skip", *EXPLODE, "--train.nan_policy=skip_step"),
        work["env"],
        work["logs"],
    )
    assert child.proc.returncode == 0, child.stderr[-3000:]
    from rewardax.logging import read_metrics

    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in rows] == ALL_STEPS
    flags = [r["nonfinite"] == 1.0 for r in rows]
    assert sum(flags) >= TOTAL_STEPS // 2, "the absurd learning rate should break most steps"
    # skipped_steps is the running count of non-finite steps.
    assert [r["skipped_steps"] for r in rows] == list(np.cumsum(flags))
    assert child.summary()["train_loss"] is not None
    # A skipped update is not applied: the parameters saved at a skipped step s are those of step
    # s - 1, bit for bit (a checkpoint is written every step here).
    bad_steps = [step for step, bad in zip(ALL_STEPS, flags, strict=True) if bad and step > 1]
    for step in bad_steps[:3]:
        before = checkpoint_arrays(run / "checkpoints" / str(step - 1))
        after = checkpoint_arrays(run / "checkpoints" / str(step))
        params = [k for k in before if k.startswith("['params']")]
        assert params, sorted(before)[:5]
        for name in params:
            assert after[name].tobytes() == before[name].tobytes(), (step, name)
    assert all(np.isfinite(t).all() for t in exported_tensors(run).values())
