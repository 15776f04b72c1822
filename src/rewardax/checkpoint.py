"""Training checkpoints on Orbax: state arrays + a JSON side-car, atomic, with a safe resume.

One checkpoint is a step directory ``<root>/<step>/`` holding two Orbax items:

- ``state``: a PyTree of arrays (parameters, optimizer state, RNG key *data*, step counter), written
  with ``StandardSave`` so every array keeps its dtype bit for bit and can be restored under another
  mesh (the sharding comes from the abstract state given to :meth:`TrainCheckpointer.restore`);
- ``extra``: a JSON object (data-iterator state, the config as a dict, metrics).

Orbax writes into ``<step>.orbax-checkpoint-tmp-<n>`` and renames it on success, so a process killed
mid-write leaves only a temporary directory, which is never listed as a step (and is removed the next
time a :class:`TrainCheckpointer` opens the directory). Saves are synchronous: when :meth:`save`
returns the checkpoint is on disk, which is what a SIGTERM handler needs before exiting.

Multi-host: every process constructs the checkpointer and calls ``save`` / ``restore`` with its
shards; Orbax synchronises the processes and the primary host (process 0) writes the metadata. The
decision to skip a checkpoint that fails to load is agreed by all processes (a failure on any of
them skips it on all), so they always resume from the same step.

Over 500 lines: save, restore, the resume policy and the classification of restore errors
(mismatch, corruption, out of memory) are one contract and are kept together.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rewardax.errors import CheckpointError, ConfigError

# The sub-directory of a run directory that holds the step directories.
CHECKPOINT_SUBDIR = "checkpoints"
_STEP_NAME = re.compile(r"^(0|[1-9]\d*)$")
_TMP_MARKER = ".orbax-checkpoint-tmp"


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint could not be loaded and an older one is used instead."""


@dataclasses.dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint passed over during restore: its step, its directory and why it failed."""

    step: int
    path: Path
    reason: str


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What :meth:`TrainCheckpointer.restore` returns.

    Unpacks as ``step, state, extra = result``; ``skipped`` lists newer checkpoints that could not
    be loaded (already reported with ``warnings.warn``) so the trainer can log them too; ``path`` is
    the step directory that was loaded.
    """

    step: int
    state: Any
    extra: dict[str, Any]
    skipped: tuple[SkippedCheckpoint, ...] = ()
    # The step directory the state was loaded from (it may be another run's, see ResumeTarget).
    path: Path | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.step, self.state, self.extra))


@dataclasses.dataclass(frozen=True)
class ResumeTarget:
    """Where to resume from: a checkpoints root and a step (``None``: the latest valid one)."""

    root: Path
    step: int | None


def _finalized_steps(root: Path) -> list[int]:
    """Steps of the committed step directories under ``root`` (temporary ones excluded), sorted."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and _STEP_NAME.match(p.name))


def _json_problem(value: Any, where: str = "extra") -> str | None:
    """The first path in ``value`` that JSON cannot encode, with its type, or None if all is fine."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has a non-string key {key!r} ({type(key).__name__})"
            if problem := _json_problem(item, f"{where}[{key!r}]"):
                return problem
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if problem := _json_problem(item, f"{where}[{i}]"):
                return problem
        return None
    if value is None or isinstance(value, str | bool | int | float):
        return None
    return f"{where} is a {type(value).__name__}, which JSON cannot store"


# Substrings of OS / TensorStore error texts -> what happened, in plain words.
_OS_CAUSES = (
    (("No space left", "os_error_code='28'"), "the disk is full"),
    (("File too large", "os_error_code='27'"), "a file-size limit (ulimit -f) was hit"),
    (("Disk quota exceeded", "os_error_code='122'"), "the disk quota is exceeded"),
    (("Permission denied", "os_error_code='13'"), "permission was denied"),
    (("Read-only file system", "os_error_code='30'"), "the file system is read-only"),
)


def _describe(exc: BaseException) -> str:
    """The error and its cause chain in one line (Orbax wraps TensorStore and OS errors)."""
    parts = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < 3:
        seen.add(id(current))
        text = " ".join(str(current).split())
        parts.append(f"{type(current).__name__}: {text[:800]}")
        current = current.__cause__ or current.__context__
    described = " <- ".join(parts)
    for needles, meaning in _OS_CAUSES:
        if any(needle in described for needle in needles):
            return f"{meaning} ({described})"
    return described


def _abandoned_read_report(unraisable: Any) -> bool:
    """True for the unraisable-exception reports an abandoned Orbax restore leaves behind.

    When one array of a checkpoint cannot be read, Orbax (0.12) stops waiting for the others and
    closes its event loop: each pending read coroutine, collected later, reports its own wrapped
    error ("Exception ignored in: <coroutine ... _read_array_index_and_device_put>", a page of
    TensorStore spec each), and each TensorStore read that finishes afterwards reports "Event loop
    is closed" from asyncio's ``call_soon_threadsafe``. A corrupt checkpoint of a small model
    printed 5,000 such lines, from other threads, in the middle of rewardax's own error line.
    """
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    exc = unraisable.exc_value
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
        return False
    frames = []
    tb = unraisable.exc_traceback
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return "call_soon_threadsafe" in frames


_previous_unraisablehook: Any = None


def _drop_abandoned_read_reports() -> None:
    """Installs (once per process) a ``sys.unraisablehook`` that drops only the reports
    :func:`_abandoned_read_report` recognises and hands every other one to the hook it replaced.

    Installed before a restore is attempted and left in place: the reports arrive from
    TensorStore's threads and the garbage collector at any time after the failed attempt.
    """
    global _previous_unraisablehook
    if _previous_unraisablehook is not None:
        return
    _previous_unraisablehook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _abandoned_read_report(unraisable):
            _previous_unraisablehook(unraisable)

    sys.unraisablehook = hook


def _all_processes_agree(ok: bool) -> bool:
    """True only if ``ok`` holds on every process (a no-op on a single process)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray(int(ok), dtype=np.int32))
    return bool(np.all(flags))


# What a damaged step directory raises on restore (see TrainCheckpointer._try_restore).
_CORRUPTION_ERRORS = (OSError, ValueError, KeyError)


def _is_corruption(exc: BaseException) -> bool:
    """True when `exc`, or an error it wraps, reports an unreadable or missing file: Orbax
    re-raises TensorStore's `ValueError: OUT_OF_RANGE: Error reading ...` (a truncated array
    file) as a bare `Exception` whose cause is that ValueError."""
    current: BaseException | None = exc
    for _ in range(4):
        if current is None:
            return False
        if isinstance(current, _CORRUPTION_ERRORS):
            return True
        current = current.__cause__ or current.__context__
    return False


def _out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure, however Orbax/TensorStore/XLA wrapped it."""
    current: BaseException | None = exc
    for _ in range(4):
        if current is None:
            return False
        if isinstance(current, MemoryError) or "RESOURCE_EXHAUSTED" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def _key_name(key: Any) -> str | int:
    """One path entry: a dict key or attribute name (Orbax's metadata tree turns an optax
    NamedTuple's attributes into dict keys, so both compare equal), or a sequence index."""
    if hasattr(key, "idx"):
        return int(key.idx)
    for attr in ("key", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _first_mismatch(stored: Any, abstract: Any) -> str | None:
    """The first array whose presence, shape or dtype differs between a checkpoint's metadata
    tree and the abstract state, in words; None when the layouts agree."""

    def layout(tree: Any) -> dict[tuple[str | int, ...], Any]:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {tuple(_key_name(k) for k in path): leaf for path, leaf in leaves}

    def name(path: tuple[str | int, ...]) -> str:
        return "state" + "".join(f"[{part!r}]" for part in path)

    saved, wanted = layout(stored), layout(abstract)
    for path, want in wanted.items():
        if path not in saved:
            return f"{name(path)} is not in the checkpoint"
        have = saved[path]
        if tuple(have.shape) != tuple(want.shape) or np.dtype(have.dtype) != np.dtype(want.dtype):
            return (
                f"{name(path)} is {np.dtype(have.dtype).name}{list(have.shape)} in the checkpoint "
                f"and {np.dtype(want.dtype).name}{list(want.shape)} in this run"
            )
    for path in saved:
        if path not in wanted:
            return f"the checkpoint holds {name(path)}, which this run's state has not"
    return None


class TrainCheckpointer:
    """Saves and restores training checkpoints under one directory, keeping the newest ones.

    Args:
        directory: the checkpoints root (conventionally ``run_dir / CHECKPOINT_SUBDIR``); created if
            missing unless ``read_only``.
        max_to_keep: how many of the newest checkpoints to keep (``None``: keep all). Older ones are
            deleted only after a newer save has been committed.
        process_index: this process's index (default ``jax.process_index()``, which is what Orbax
            uses); process 0 does the renames/deletions this class adds to Orbax's own.
        read_only: open an existing directory (e.g. another run's) without ever writing to it.

    Example::

        ckpt = TrainCheckpointer(run_dir / "checkpoints", max_to_keep=3)
        ckpt.save(100, {"params": params, "opt": opt_state, "rng": jax.random.key_data(key),
                        "step": jnp.int32(100)}, {"data": it.get_state(), "config": cfg})
        step, state, extra = ckpt.restore(jax.eval_shape(lambda: state_like))  # needs .sharding
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None,
        process_index: int | None = None,
        read_only: bool = False,
    ) -> None:
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ConfigError(
                f"max_to_keep must be a positive integer or None (keep all), got {max_to_keep!r}"
            )
        self.directory = Path(directory).absolute()
        self.max_to_keep = max_to_keep
        self.read_only = read_only
        self.process_index = jax.process_index() if process_index is None else process_index
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        # Steps found unloadable by restore(): a later save at the same step moves them aside.
        self._bad_steps: set[int] = set()
        self._barriers = 0
        if not read_only:
            self._remove_interrupted_writes()
        self._manager = self._open_manager()

    def _open_manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if self.read_only else self.max_to_keep,
            # Synchronous: save() returns only once the step directory is committed.
            enable_async_checkpointing=False,
            create=not self.read_only,
            # Interrupted writes are removed by _remove_interrupted_writes, synchronously: Orbax's
            # own cleanup runs in the background and may still be going when save() returns.
            cleanup_tmp_directories=False,
            read_only=self.read_only,
            # The step times/metrics are never used; skip reading every step's metadata.
            lightweight_initialize=True,
        )
        try:
            return ocp.CheckpointManager(
                self.directory,
                options=options,
                item_handlers={
                    "state": ocp.StandardCheckpointHandler(),
                    "extra": ocp.JsonCheckpointHandler(),
                },
            )
        except OSError as exc:
            raise CheckpointError(
                f"cannot open checkpoint directory {self.directory}: {_describe(exc)}"
            ) from exc

    def _remove_interrupted_writes(self) -> None:
        """Deletes ``*.orbax-checkpoint-tmp*`` directories (killed or failed saves; never listed)."""
        if self.process_index == 0 and self.directory.is_dir():
            for path in self.directory.iterdir():
                if _TMP_MARKER in path.name:
                    shutil.rmtree(path, ignore_errors=True)
        self._barrier("remove_interrupted_writes")

    def _barrier(self, name: str) -> None:
        # Barrier names must be unique per call, hence the counter.
        self._barriers += 1
        ocp.multihost.sync_global_processes(f"rewardax_{name}_{self._barriers}")

    # ----------------------------------------------------------------------------------- listing
    def steps(self) -> list[int]:
        """Committed checkpoint steps, ascending (interrupted writes are never listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None; it may still fail to load (see :meth:`restore`)."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> Path:
        """The directory of checkpoint ``step``."""
        return self.directory / str(step)

    # ------------------------------------------------------------------------------------ saving
    def save(self, step: int, state: Any, extra: dict[str, Any], *, force: bool = False) -> bool:
        """Writes checkpoint ``step`` and returns once it is committed on disk.

        Args:
            step: the training step (a non-negative int); the directory is ``<root>/<step>``.
            state: a PyTree of arrays (jax or numpy); typed PRNG keys must be passed as
                ``jax.random.key_data(key)``.
            extra: a JSON-serialisable dict (data iterator state, config dict, metrics).
            force: if a committed checkpoint for ``step`` exists, replace it. Without ``force`` an
                existing valid one is kept and nothing is written (so a SIGTERM handler may save
                the step a periodic save just wrote); one that :meth:`restore` found unloadable is
                always replaced (moved aside to ``<step>.corrupt-<time>``, not deleted).

        Returns:
            True if a checkpoint was written, False if a valid one for ``step`` already existed.

        Raises:
            CheckpointError: the checkpointer is read-only, ``extra`` is not JSON, or the write
                failed (disk full, permissions, ...). The earlier checkpoints are left intact.
        """
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read-only; cannot save step {step}")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
        step = int(step)
        if not isinstance(extra, dict):
            raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}")
        if problem := _json_problem(extra):
            raise CheckpointError(
                f"cannot save step {step}: {problem}; convert it to numbers/strings/lists first"
            )
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(
                leaf.dtype, jax.dtypes.prng_key
            ):
                raise CheckpointError(
                    f"state{jax.tree_util.keystr(path)} is a typed PRNG key; save "
                    "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data"
                )

        moved_aside: Path | None = None
        replacing_valid = False
        if step in self.steps():
            if not force and step not in self._bad_steps:
                return False
            replacing_valid = step not in self._bad_steps
            moved_aside = self._move_aside(step, "replaced" if replacing_valid else "corrupt")

        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)
        )
        try:
            # force=True bypasses Orbax's own save-interval policy: the trainer decides when to save.
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
        except Exception as exc:
            # A fresh manager forgets the failed step; deleting its temporary directory frees the
            # space it took.
            self._manager.close()
            self._remove_interrupted_writes()
            self._manager = self._open_manager()
            if replacing_valid and moved_aside is not None and self.process_index == 0:
                moved_aside.rename(self.step_path(step))
            raise CheckpointError(
                f"saving checkpoint step {step} under {self.directory} failed: {_describe(exc)}. "
                f"Nothing was committed for this step; the earlier checkpoints {self.steps()} are "
                "intact. Check free disk space, file-size limits and write permission."
            ) from exc
        self._bad_steps.discard(step)
        if replacing_valid and moved_aside is not None and self.process_index == 0:
            shutil.rmtree(moved_aside, ignore_errors=True)
        return True

    def _move_aside(self, step: int, why: str) -> Path:
        """Renames ``<root>/<step>`` to a name Orbax does not list; returns the new path."""
        target = self.directory / f"{step}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"
        if self.process_index == 0:
            self.step_path(step).rename(target)
        self._barrier(f"move_aside_{step}")
        self._manager.reload()
        return target

    # --------------------------------------------------------------------------------- restoring
    def restore(self, abstract_state: Any, step: int | ResumeTarget | None = None) -> RestoreResult:
        """Loads checkpoint ``step`` (None: the newest one that loads) into ``abstract_state``'s layout.

        Args:
            abstract_state: the state's PyTree with ``jax.ShapeDtypeStruct`` leaves (or arrays) whose
                ``.sharding`` says where each restored array goes: a checkpoint written under one
                mesh is resharded onto this one. Leaves without a sharding go to the first device
                (single-process only).
            step: the step to load. An explicit step that cannot be loaded is an error; with None,
                a newer checkpoint that fails to load is skipped with a
                :class:`CorruptCheckpointWarning` naming its directory, and the next older is tried.
                A :class:`ResumeTarget` (from :func:`resolve_resume`) may name another directory,
                which is then read without being modified.

        Returns:
            A :class:`RestoreResult`: ``step, state, extra = result``; ``result.skipped`` lists the
            checkpoints passed over.

        Raises:
            CheckpointError: no checkpoint exists, the requested step is missing or unloadable,
                none of the checkpoints loads (the reasons are listed; this never falls back to a
                fresh start), or a checkpoint's arrays do not have ``abstract_state``'s structure,
                shapes and dtypes (the model/optimizer configuration differs from the run that
                wrote it: the first mismatching array is named, and no older checkpoint is tried,
                since they were written by the same run).

        Only a missing, truncated or unreadable file, or unreadable metadata, counts as corruption
        (skipped with a warning); any other error (out of memory, a bug) propagates as it is.
        """
        if isinstance(step, ResumeTarget):
            if step.root.resolve() != self.directory.resolve():
                with TrainCheckpointer(step.root, max_to_keep=None, read_only=True) as other:
                    return other.restore(abstract_state, step.step)
            step = step.step
        abstract = self._abstract(abstract_state)
        available = self.steps()
        if step is not None:
            if step not in available:
                raise CheckpointError(
                    f"checkpoint step {step} does not exist under {self.directory} "
                    f"(committed steps: {available or 'none'})"
                )
            state, extra, error = self._try_restore(step, abstract)
            if error is not None:
                self._bad_steps.add(step)
                raise CheckpointError(
                    f"checkpoint step {step} ({self.step_path(step)}) cannot be loaded: {error}. "
                    "Choose another "
                    f"step (committed: {available}) or check that the model and optimizer "
                    "configuration match the run that wrote it."
                )
            return RestoreResult(step, state, extra, path=self.step_path(step))

        if not available:
            raise CheckpointError(f"no checkpoint under {self.directory}")
        skipped: list[SkippedCheckpoint] = []
        for candidate in reversed(available):
            state, extra, error = self._try_restore(candidate, abstract)
            if error is None:
                return RestoreResult(
                    candidate, state, extra, tuple(skipped), path=self.step_path(candidate)
                )
            self._bad_steps.add(candidate)
            bad = SkippedCheckpoint(candidate, self.step_path(candidate), error)
            skipped.append(bad)
            warnings.warn(
                f"checkpoint {bad.path} cannot be loaded ({error}); trying an older one",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
        reasons = "; ".join(f"{s.path}: {s.reason}" for s in skipped)
        raise CheckpointError(
            f"none of the checkpoints under {self.directory} can be loaded ({reasons}). They are "
            "corrupt or were written for a different model/optimizer configuration; refusing to "
            "start from scratch. Pass resume=off to start a fresh run in a new directory."
        )

    def _try_restore(
        self, step: int, abstract: Any
    ) -> tuple[Any, dict[str, Any] | None, str | None]:
        """Restores one step; returns (state, extra, None) or (None, None, why it is corrupt).

        Raises CheckpointError when the stored arrays do not match ``abstract`` (checked on the
        metadata, before any array is read); lets every error that is not corruption propagate.
        """
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()
        )
        error: str | None = None
        state = extra = None
        _drop_abandoned_read_reports()
        try:
            stored = self._manager.item_metadata(step)["state"]
            if stored is None:
                error = "its array metadata (state/_METADATA) is missing"
            elif mismatch := _first_mismatch(stored, abstract):
                raise CheckpointError(
                    f"checkpoint step {step} ({self.step_path(step)}) does not fit this run's "
                    f"state: {mismatch}. The model or optimizer configuration differs from the "
                    "run that wrote it; resume with that run's configuration, or start a new run "
                    "(another checkpoint.run_name, or checkpoint.resume=off in a new directory)"
                )
            else:
                restored = self._manager.restore(step, args=args)
                state, extra = restored["state"], restored["extra"]
                if not isinstance(extra, dict):
                    error = f"its extra item is a {type(extra).__name__}, not a JSON object"
        except CheckpointError:
            raise
        except Exception as exc:
            # Orbax/TensorStore report an unreadable file as OSError or ValueError (JSON errors
            # included), possibly wrapped, and a missing item as KeyError; TensorStore reports
            # running out of memory with the same types, which is not corruption.
            if _out_of_memory(exc) or not _is_corruption(exc):
                raise
            error = _describe(exc)
        if not _all_processes_agree(error is None):
            error = error or "another process could not load it"
        return (None, None, error) if error else (state, extra, None)

    @staticmethod
    def _abstract(abstract_state: Any) -> Any:
        """ShapeDtypeStructs with a sharding for every leaf of ``abstract_state``."""

        def one(leaf: Any) -> jax.ShapeDtypeStruct:
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                if jax.process_count() > 1:
                    raise CheckpointError(
                        "every leaf of abstract_state needs a .sharding on a multi-process run"
                    )
                sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

        return jax.tree.map(one, abstract_state)

    # ------------------------------------------------------------------------------------ resume
    def resume(
        self, resume: str | os.PathLike[str] | None, abstract_state: Any
    ) -> RestoreResult | None:
        """Restores according to a ``resume`` setting, or returns None for a fresh start.

        ``"auto"``: the newest valid checkpoint in this directory, None if it holds none (a fresh
        start); ``"off"``/None: None; a path: that checkpoint (see :func:`resolve_resume`), which
        must load. Corrupt checkpoints are skipped only when no explicit step was named.
        """
        target = resolve_resume(resume, self.directory)
        if target is None:
            return None
        return self.restore(abstract_state, target)

    def close(self) -> None:
        """Waits for pending work and releases Orbax's resources."""
        self._manager.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def resolve_resume(
    resume: str | os.PathLike[str] | None,
    checkpoint_dir: str | os.PathLike[str] | TrainCheckpointer,
) -> ResumeTarget | None:
    """Turns a ``resume`` setting into the checkpoint to load, without loading it.

    Args:
        resume: ``"auto"`` (the newest checkpoint under ``checkpoint_dir``, if any), ``"off"`` or
            None (fresh start), or a path: a step directory (``.../checkpoints/120``), a
            checkpoints root, or a run directory containing ``checkpoints/``.
        checkpoint_dir: this run's checkpoints root (or its :class:`TrainCheckpointer`).

    Returns:
        A :class:`ResumeTarget` (``step`` None means the newest valid one), or None for a fresh
        start: ``"off"``, or ``"auto"`` with no committed checkpoint (an interrupted first save
        leaves none, and starting fresh is then right).

    Raises:
        CheckpointError: a path that holds no committed checkpoint (including an interrupted
            ``*.orbax-checkpoint-tmp-*`` directory).
    """
    if resume is None or resume == "off":
        return None
    if isinstance(checkpoint_dir, TrainCheckpointer):
        checkpoint_dir = checkpoint_dir.directory
    root = Path(checkpoint_dir).absolute()
    if resume == "auto":
        return ResumeTarget(root, None) if _finalized_steps(root) else None
    path = Path(resume).expanduser().absolute()
    if _TMP_MARKER in path.name:
        raise CheckpointError(
            f"resume path {path} is an interrupted (uncommitted) checkpoint write; "
            f"use a committed step directory from {path.parent}"
        )
    if not path.exists():
        raise CheckpointError(f"resume path {path} does not exist")
    if (
        _STEP_NAME.match(path.name)
        and path.is_dir()
        and int(path.name) in _finalized_steps(path.parent)
    ):
        return ResumeTarget(path.parent, int(path.name))
    for candidate in (path, path / CHECKPOINT_SUBDIR):
        if _finalized_steps(candidate):
            return ResumeTarget(candidate, None)
    raise CheckpointError(
        f"resume path {path} holds no committed checkpoint: give a step directory "
        f"(e.g. {path / CHECKPOINT_SUBDIR / '100'}), a checkpoints root or a run directory"
    )
