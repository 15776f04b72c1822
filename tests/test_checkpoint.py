"""TrainCheckpointer: exact round trips, retention, corruption fallback, crashes and full disks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rewardax.checkpoint import (
    CHECKPOINT_SUBDIR,
    CorruptCheckpointWarning,
    ResumeTarget,
    TrainCheckpointer,
    resolve_resume,
)
from rewardax.errors import CheckpointError, ConfigError

# A failed read leaves Orbax's pending TensorStore coroutines to be garbage-collected, which pytest
# reports as unraisable exceptions; they are Orbax internals, not leaks of ours.
pytestmark = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning"),
]


def make_state(seed: int) -> dict:
    """A small training state with every dtype a run checkpoints."""
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    return {
        "params": {
            "w": jax.random.normal(k1, (4, 8), jnp.float32),
            "emb": jax.random.normal(k2, (16, 4), jnp.bfloat16),
        },
        "opt": [jnp.full((4, 8), seed * 0.5, jnp.float32), jnp.int32(seed)],
        "rng": jax.random.key_data(key),  # uint32 [2]
        "step": jnp.int32(seed * 10),
    }


def abstract_of(state: dict) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def data_files(step_dir: Path) -> list[Path]:
    """The files holding the array bytes of a checkpoint (state/d/*: the merged OCDBT data)."""
    files = sorted(p for p in (step_dir / "state" / "d").iterdir() if p.is_file())
    assert files, f"no array data files in {step_dir}"
    return files


def truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def run_python(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_round_trip_is_bitwise_and_unpacks_to_three(tmp_path: Path) -> None:
    state = make_state(3)
    extra = {"data": {"epoch": 1, "index": 37}, "config": {"lr": 2e-5, "name": "x"}, "loss": 0.25}
    with TrainCheckpointer(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.save(30, state, extra) is True
        assert ckpt.steps() == [30] and ckpt.latest_step() == 30
        step, restored, restored_extra = ckpt.restore(abstract_of(state))
    assert step == 30
    assert restored_extra == extra
    assert_bitwise_equal(restored, state)
    assert restored["params"]["emb"].dtype == jnp.bfloat16


def test_max_to_keep_keeps_the_newest(tmp_path: Path) -> None:
    with TrainCheckpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, make_state(step), {"s": step})
        assert ckpt.steps() == [3, 4]
        _, state, extra = ckpt.restore(abstract_of(make_state(0)), step=3)
    assert extra == {"s": 3}
    assert_bitwise_equal(state, make_state(3))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]


def test_existing_step_is_kept_unless_forced(tmp_path: Path) -> None:
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        assert ckpt.save(5, make_state(1), {"v": 1})
        assert ckpt.save(5, make_state(2), {"v": 2}) is False
        assert ckpt.restore(abstract_of(make_state(0))).extra == {"v": 1}
        assert ckpt.save(5, make_state(2), {"v": 2}, force=True)
        result = ckpt.restore(abstract_of(make_state(0)))
    assert result.extra == {"v": 2}
    assert_bitwise_equal(result.state, make_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5"]  # the replaced copy is gone


def test_corrupt_latest_falls_back_with_a_warning_naming_it(tmp_path: Path) -> None:
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make_state(step), {"s": step})
        truncate(data_files(tmp_path / "2")[0])
        with pytest.warns(CorruptCheckpointWarning, match=str(tmp_path / "2")):
            result = ckpt.restore(abstract_of(make_state(0)))
        assert result.step == 1 and result.extra == {"s": 1}
        assert_bitwise_equal(result.state, make_state(1))
        assert [s.step for s in result.skipped] == [2]
        assert result.skipped[0].path == tmp_path / "2"
        # Training continues from 1 and reaches step 2 again: the corrupt one is moved aside.
        assert ckpt.save(2, make_state(7), {"s": 7})
        assert ckpt.steps() == [1, 2]
        assert ckpt.restore(abstract_of(make_state(0))).extra == {"s": 7}
    assert any(p.name.startswith("2.corrupt-") for p in tmp_path.iterdir())


def test_deleted_file_counts_as_corrupt(tmp_path: Path) -> None:
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make_state(step), {"s": step})
        (tmp_path / "2" / "extra" / "metadata").unlink()
        with pytest.warns(CorruptCheckpointWarning, match="extra"):
            assert ckpt.restore(abstract_of(make_state(0))).step == 1


def test_all_corrupt_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make_state(step), {"s": step})
        for step in (1, 2):
            truncate(data_files(tmp_path / str(step))[0])
        with (
            pytest.warns(CorruptCheckpointWarning),
            pytest.raises(CheckpointError, match="none of the checkpoints") as info,
        ):
            ckpt.restore(abstract_of(make_state(0)))
        assert str(tmp_path / "1") in str(info.value) and str(tmp_path / "2") in str(info.value)
        # resume=auto must not turn this into a fresh start either.
        with pytest.warns(CorruptCheckpointWarning), pytest.raises(CheckpointError):
            ckpt.resume("auto", abstract_of(make_state(0)))


def test_explicit_bad_or_missing_step_is_an_error(tmp_path: Path) -> None:
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make_state(step), {"s": step})
        truncate(data_files(tmp_path / "1")[0])
        with pytest.raises(
            CheckpointError, match=f"step 1 \\({tmp_path / '1'}\\) cannot be loaded"
        ):
            ckpt.restore(abstract_of(make_state(0)), step=1)
        with pytest.raises(CheckpointError, match="step 9 does not exist"):
            ckpt.restore(abstract_of(make_state(0)), step=9)
        with pytest.raises(
            CheckpointError, match=f"step 1 \\({tmp_path / '1'}\\) cannot be loaded"
        ):
            ckpt.resume(tmp_path / "1", abstract_of(make_state(0)))


def test_mismatched_state_layout_is_an_error(tmp_path: Path) -> None:
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        ckpt.save(1, make_state(1), {})
        wrong = abstract_of(make_state(1))
        wrong["params"]["w"] = jax.ShapeDtypeStruct((5, 8), jnp.float32)
        with pytest.raises(CheckpointError, match="step 1"):
            ckpt.restore(wrong, step=1)


def test_bad_inputs_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_to_keep"):
        TrainCheckpointer(tmp_path, max_to_keep=0)
    with TrainCheckpointer(tmp_path, max_to_keep=1) as ckpt:
        with pytest.raises(CheckpointError, match=r"extra\['data'\]\['it'\] is a ndarray"):
            ckpt.save(1, make_state(1), {"data": {"it": np.zeros(2)}})
        with pytest.raises(CheckpointError, match="typed PRNG key"):
            ckpt.save(1, {"rng": jax.random.key(0)}, {})
        with pytest.raises(CheckpointError, match="no checkpoint under"):
            ckpt.restore(abstract_of(make_state(0)))
        assert ckpt.steps() == []


def test_resolve_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    root = run_dir / CHECKPOINT_SUBDIR
    assert resolve_resume("off", root) is None
    assert resolve_resume(None, root) is None
    assert resolve_resume("auto", root) is None  # nothing saved yet: a fresh start is right
    with TrainCheckpointer(root, max_to_keep=3) as ckpt:
        ckpt.save(4, make_state(4), {"s": 4})
        ckpt.save(8, make_state(8), {"s": 8})
    (root / "12.orbax-checkpoint-tmp-123").mkdir()  # an interrupted write
    assert resolve_resume("auto", root) == ResumeTarget(root, None)
    assert resolve_resume(str(root / "4"), tmp_path / "other") == ResumeTarget(root, 4)
    assert resolve_resume(root, tmp_path / "other") == ResumeTarget(root, None)
    assert resolve_resume(run_dir, tmp_path / "other") == ResumeTarget(root, None)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume(tmp_path / "nope", root)
    with pytest.raises(CheckpointError, match="interrupted"):
        resolve_resume(root / "12.orbax-checkpoint-tmp-123", root)
    with pytest.raises(CheckpointError, match="holds no committed checkpoint"):
        resolve_resume(tmp_path, root)
    # Resuming a new run from another run's checkpoint reads it without modifying it.
    with TrainCheckpointer(tmp_path / "new", max_to_keep=3) as ckpt:
        result = ckpt.resume(root / "4", abstract_of(make_state(0)))
        assert result is not None and result.step == 4 and result.extra == {"s": 4}
        assert ckpt.resume("auto", abstract_of(make_state(0))) is None
        assert ckpt.resume("off", abstract_of(make_state(0))) is None
        # The two-step form: resolve, then restore the target (the checkpointer stands for its dir).
        target = resolve_resume(str(root), ckpt)
        assert target == ResumeTarget(root, None)
        assert ckpt.restore(abstract_of(make_state(0)), step=target).step == 8
    assert sorted(p.name for p in root.iterdir()) == ["12.orbax-checkpoint-tmp-123", "4", "8"]


def test_sigkill_during_a_save_leaves_previous_intact(tmp_path: Path) -> None:
    # The process dies right before Orbax's commit rename: the bytes are written, nothing is
    # committed. That directory must never be listed, and step 1 must restore.
    code = f"""
        import os, signal
        import jax.numpy as jnp
        from orbax.checkpoint._src.path import atomicity
        from rewardax.checkpoint import TrainCheckpointer
        ckpt = TrainCheckpointer({str(tmp_path)!r}, max_to_keep=1)
        ckpt.save(1, {{"w": jnp.ones((64, 64))}}, {{"s": 1}})
        async def die(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        atomicity.AtomicRenameTemporaryPath.finalize = die
        ckpt.save(2, {{"w": jnp.zeros((64, 64))}}, {{"s": 2}})
        print("not killed")
    """
    proc = run_python(code)
    assert proc.returncode == -9, proc.stdout + proc.stderr[-3000:]
    leftovers = [p.name for p in tmp_path.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert leftovers and leftovers[0].startswith("2.")
    abstract = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    with TrainCheckpointer(tmp_path, max_to_keep=1) as ckpt:
        assert ckpt.steps() == [1]
        step, state, extra = ckpt.restore(abstract)
        assert (step, extra) == (1, {"s": 1})
        np.testing.assert_array_equal(np.asarray(state["w"]), np.ones((64, 64), np.float32))
    # Reopening for writing removed the interrupted directory.
    assert not [p for p in tmp_path.iterdir() if ".orbax-checkpoint-tmp" in p.name]


def test_disk_full_save_fails_cleanly(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes write() fail with EFBIG past 64 KiB (SIGXFSZ ignored, else it kills us).
    code = f"""
        import resource, signal, os
        import jax, jax.numpy as jnp, numpy as np
        from rewardax.checkpoint import TrainCheckpointer
        from rewardax.errors import CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        root = {str(tmp_path)!r}
        small = {{"w": jnp.arange(16, dtype=jnp.float32)}}
        big = {{"w": jnp.asarray(np.random.default_rng(0).normal(size=16).astype(np.float32)),
               "big": jnp.asarray(np.random.default_rng(1).normal(size=(512, 512)), jnp.float32)}}
        ckpt = TrainCheckpointer(root, max_to_keep=1)
        ckpt.save(1, small, {{"s": 1}})
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        try:
            ckpt.save(2, big, {{"s": 2}})
            print("NO ERROR")
        except CheckpointError as e:
            print("ERROR:", e)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        print("STEPS", ckpt.steps())
        print("TMP", [p for p in os.listdir(root) if "tmp" in p])
        abstract = {{"w": jax.ShapeDtypeStruct((16,), jnp.float32)}}
        step, state, extra = ckpt.restore(abstract)
        print("RESTORED", step, extra, np.asarray(state["w"]).tolist() == list(range(16)))
        ckpt.save(3, small, {{"s": 3}})  # works again once space is back
        print("AFTER", ckpt.steps())
    """
    proc = run_python(code)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    error_line = next(line for line in out.splitlines() if line.startswith("ERROR:"))
    assert "step 2" in error_line and "[1] are intact" in error_line
    assert "a file-size limit (ulimit -f) was hit" in error_line and "File too large" in error_line
    assert "STEPS [1]" in out
    assert "TMP []" in out
    assert "RESTORED 1 {'s': 1} True" in out
    assert "AFTER [3]" in out


def test_restore_reshards_onto_another_mesh(tmp_path: Path) -> None:
    code = f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
        from rewardax.checkpoint import TrainCheckpointer
        devices = np.array(jax.devices())
        assert devices.size == 4, devices
        x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
        y = jnp.arange(8, dtype=jnp.bfloat16)
        line = Mesh(devices, ("data",))
        state = {{"x": jax.device_put(x, NamedSharding(line, P("data", None))),
                  "y": jax.device_put(y, NamedSharding(line, P()))}}
        ckpt = TrainCheckpointer({str(tmp_path)!r}, max_to_keep=1)
        ckpt.save(1, state, {{}})
        grid = Mesh(devices.reshape(2, 2), ("a", "b"))
        targets = {{"x": NamedSharding(grid, P("b", "a")), "y": SingleDeviceSharding(devices[3])}}
        abstract = {{k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=targets[k])
                     for k, v in state.items()}}
        _, restored, _ = ckpt.restore(abstract)
        for k in state:
            assert restored[k].sharding == targets[k], (k, restored[k].sharding)
            assert np.asarray(restored[k]).tobytes() == np.asarray(state[k]).tobytes(), k
        assert restored["x"].addressable_shards[0].data.shape == (4, 3)
        print("OK")
    """
    proc = run_python(code, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_a_layout_mismatch_is_an_error_naming_the_array_not_a_fallback(tmp_path: Path) -> None:
    """A state built for another model/optimizer config fails every checkpoint of the run alike:
    resume must say so and name the array, not warn, skip the newest and try older ones."""
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make_state(step), {"s": step})
        shape = abstract_of(make_state(0))
        shape["params"]["w"] = jax.ShapeDtypeStruct((5, 8), jnp.float32)
        dtype = abstract_of(make_state(0))
        dtype["params"]["emb"] = jax.ShapeDtypeStruct((16, 4), jnp.float32)  # saved bfloat16
        missing = abstract_of(make_state(0))
        missing["opt"].append(jax.ShapeDtypeStruct((3,), jnp.float32))
        extra_leaf = abstract_of(make_state(0))
        del extra_leaf["rng"]
        cases = [
            (
                shape,
                r"state\['params'\]\['w'\] is float32\[4, 8\] in the checkpoint and "
                r"float32\[5, 8\] in this run",
            ),
            (
                dtype,
                r"state\['params'\]\['emb'\] is bfloat16\[16, 4\] in the checkpoint and "
                r"float32\[16, 4\]",
            ),
            (missing, r"state\['opt'\]\[2\] is not in the checkpoint"),
            (extra_leaf, r"the checkpoint holds state\['rng'\]"),
        ]
        for abstract, message in cases:
            with warnings.catch_warnings():
                warnings.simplefilter("error", CorruptCheckpointWarning)  # no fallback
                with pytest.raises(CheckpointError, match=message) as info:
                    ckpt.restore(abstract)
            assert f"checkpoint step 2 ({tmp_path / '2'})" in str(info.value)
            assert "configuration differs from the run that wrote it" in str(info.value)
        # Nothing was marked bad: the same checkpoint loads with the right layout.
        result = ckpt.restore(abstract_of(make_state(0)))
        assert result.step == 2 and result.skipped == () and result.path == tmp_path / "2"
        assert_bitwise_equal(result.state, make_state(2))


def test_missing_array_metadata_counts_as_corrupt(tmp_path: Path) -> None:
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make_state(step), {"s": step})
        (tmp_path / "2" / "state" / "_METADATA").unlink()
        with pytest.warns(CorruptCheckpointWarning, match="_METADATA"):
            result = ckpt.restore(abstract_of(make_state(0)))
        assert result.step == 1 and result.path == tmp_path / "1"


@pytest.mark.parametrize(
    "failure",
    [MemoryError(), ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 4096 bytes")],
    ids=["MemoryError", "tensorstore-oom"],
)
def test_out_of_memory_while_restoring_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """Running out of memory says nothing about the checkpoint: it must not be skipped for an
    older one (nor marked corrupt), but reach the caller."""
    with TrainCheckpointer(tmp_path, max_to_keep=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make_state(step), {"s": step})

        def out_of_memory(*args, **kwargs):
            raise failure

        monkeypatch.setattr(ckpt._manager, "restore", out_of_memory)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CorruptCheckpointWarning)
            with pytest.raises(type(failure)) as info:
                ckpt.restore(abstract_of(make_state(0)))
        assert info.value is failure
        monkeypatch.undo()
        assert ckpt.restore(abstract_of(make_state(0))).step == 2
