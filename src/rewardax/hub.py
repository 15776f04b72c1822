"""Hugging Face hub names for models and data, resolved through the standard hub cache.

An existing local path always wins; only a string that is not one and reads as a hub name is looked
up. The syntax:

  model:  ``org/name[@revision]``            -> the snapshot directory: config.json, *.safetensors,
                                                *.safetensors.index.json, tokenizer files
          ``org/name/file.gguf[@revision]``  -> that one GGUF file (weights and tokenizer)
  data:   ``org/name[:split][@revision]``    -> a ``datasets.Dataset`` of that split; the split may
                                                carry a slice, e.g. ``org/name:test[:500]``

``revision`` is a branch, a tag or a commit hash (``Qwen/Qwen2.5-0.5B-Instruct@main``,
``org/prefs:test@v1.0``). Without ``:split``, training data reads ``train`` and eval data reads
``test``; a repo without that split but with exactly one split reads that one, and any other repo is
refused with its split names listed.

Downloads go through ``huggingface_hub.snapshot_download`` into the standard cache (``HF_HOME``,
``HF_HUB_CACHE``); with ``HF_HUB_OFFLINE=1`` only that cache is read. Models: only the files above
are fetched, never pickle weights (``*.bin``, ``*.pt``); a repo that has only those is refused with
the command that converts them. Data: the repo's data files (jsonl / json / parquet / arrow / csv,
compressed or not, every split) and README.md (its ``configs`` section) are fetched and read by
``datasets`` as a local directory, so a dataset cached by ``hf download --repo-type dataset`` or an
earlier online ``load_dataset`` works offline, at the pinned revision. Every failure is a rewardax
error naming the repo and what to do, never a huggingface_hub traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewardax.errors import DataError, ModelLoadError, RewardaxError

# Top-level files of a Hugging Face model directory that rewardax reads (weights, config, tokenizer).
MODEL_PATTERNS = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".arrow", ".csv")
DATA_PATTERNS = [
    f"*{suffix}{packed}"
    for suffix in _DATA_SUFFIXES
    for packed in ("", ".gz", ".zst", ".bz2", ".xz")
] + ["README.md"]
# A repo name ending like a file is a missing local file, not a hub name.
_FILE_LIKE = (".gguf", ".safetensors", ".yaml", ".yml", *_DATA_SUFFIXES, *PICKLE_SUFFIXES)

_REPO = r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)"
_REVISION = r"(?:@(?P<revision>[^@\s]+))?"
_MODEL_NAME = re.compile(rf"{_REPO}(?:/(?P<filename>[^@\s]+\.gguf))?{_REVISION}")
_DATA_NAME = re.compile(rf"{_REPO}(?::(?P<split>[\w.-]+(?:\[[^\]@]*\])?))?{_REVISION}")


@dataclass(frozen=True)
class HubName:
    """A parsed hub reference; `filename` (a .gguf in a model repo) or `split` (data) may be set."""

    repo_id: str
    revision: str | None = None
    filename: str | None = None
    split: str | None = None

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.filename}" if self.filename else "")
        text += f":{self.split}" if self.split else ""
        return text + (f"@{self.revision}" if self.revision else "")


def _parse(text: str, pattern: re.Pattern) -> HubName | None:
    match = pattern.fullmatch(text)
    if match is None or match["repo"].lower().endswith(_FILE_LIKE) or ".." in match["repo"]:
        return None
    groups = match.groupdict()
    return HubName(match["repo"], match["revision"], groups.get("filename"), groups.get("split"))


def parse_model_name(text: str) -> HubName | None:
    """``org/name[@revision]`` or ``org/name/file.gguf[@revision]``; None if `text` is not one."""
    return _parse(text, _MODEL_NAME)


def parse_dataset_name(text: str) -> HubName | None:
    """``org/name[:split][@revision]``; None if `text` is not one."""
    return _parse(text, _DATA_NAME)


def is_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it (at its import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _download_command(name: HubName, repo_type: str) -> str:
    parts = ["hf download", name.repo_id]
    if name.filename:
        parts.append(name.filename)
    if repo_type == "dataset":
        parts.append("--repo-type dataset")
    if name.revision:
        parts.append(f"--revision {name.revision}")
    return " ".join(parts)


@contextmanager
def _hub_errors(
    text: str, name: HubName, repo_type: str, error: type[RewardaxError]
) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line rewardax errors that say what to do."""
    from huggingface_hub import errors as hub

    kind = "dataset" if repo_type == "dataset" else "model"
    command = _download_command(name, repo_type)
    head = f"{text} is not a local path, and the hub {kind} {name.repo_id}"
    try:
        yield
    except hub.GatedRepoError:
        url = "https://huggingface.co/" + ("datasets/" if kind == "dataset" else "") + name.repo_id
        raise error(
            f"{head} is gated: accept its terms at {url} and log in (`hf auth login` or HF_TOKEN)"
        ) from None
    except hub.RepositoryNotFoundError:
        raise error(
            f"{head} does not exist on the Hugging Face hub (or it is private: log in with "
            "`hf auth login` or set HF_TOKEN)"
        ) from None
    except hub.RevisionNotFoundError:
        raise error(
            f"{head} has no revision {name.revision!r} on the Hugging Face hub; pass a branch, tag "
            "or commit hash after @"
        ) from None
    except hub.LocalEntryNotFoundError as exc:  # not (fully) in the cache and the hub unreachable
        where = f"in the Hugging Face cache ({_cache_dir()})"
        at = f" at revision {name.revision}" if name.revision else ""
        # IncompleteSnapshotError: huggingface_hub >= 2 (a download that was cut short).
        partial = isinstance(exc, getattr(hub, "IncompleteSnapshotError", ()))
        status = f"{at} is only partly {where}" if partial else f"{at} is not {where}"
        if is_offline():
            raise error(
                f"{head}{status} and HF_HUB_OFFLINE=1; run `{command}` on a machine with the hub "
                "(same HF_HOME), or unset HF_HUB_OFFLINE"
            ) from None
        raise error(
            f"{head}{status} and the hub cannot be reached; check the network (or HF_ENDPOINT), "
            f"or run `{command}` where the hub is reachable"
        ) from None
    except hub.HfHubHTTPError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(f"{head}: the Hugging Face hub refused the download ({first})") from None
    except hub.HFValidationError as exc:
        raise error(f"{head}: not a valid hub repo id ({exc})") from None
    except OSError as exc:  # disk full, permissions, a broken connection mid-download
        raise error(f"{head}: cannot download into {_cache_dir()} ({exc})") from None


def _repo_files(name: HubName, snapshot: Path, repo_type: str) -> list[str]:
    """The repo's file names at the snapshot's commit: the hub's listing when it can be asked, else
    what is known offline (the snapshot's files and, with huggingface_hub >= 2, the cached tree)."""
    files = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    if not is_offline():
        from huggingface_hub import HfApi

        with _hub_errors(str(name), name, repo_type, ModelLoadError):
            files.update(
                HfApi().list_repo_files(name.repo_id, revision=snapshot.name, repo_type=repo_type)
            )
        return sorted(files)
    try:
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:  # huggingface_hub < 2 keeps no tree listing
        return sorted(files)
    try:
        tree = get_cached_repo_tree(name.repo_id, repo_type=repo_type, revision=snapshot.name)
    except CachedRepoTreeNotFoundError:
        return sorted(files)
    return sorted(files | {f.path for f in tree})


def resolve_model_path(path: str | os.PathLike, kind: str = "model") -> Path:
    """A local model directory or .gguf file for `path`.

    Args:
      path: an existing local path (returned as is), or a hub name ``org/name[@revision]`` /
        ``org/name/file.gguf[@revision]`` (see the module docstring).
      kind: how errors name what was asked for ("model", "tokenizer").

    Returns:
      The path, or the cached snapshot directory (``.../models--org--name/snapshots/<commit>``) or
      .gguf file.

    Raises:
      ModelLoadError: the path does not exist and is no hub name; the repo is not in the cache
        (offline) or not on the hub; it has only pickle weights, or only GGUF files and none was
        named.
    """
    local = Path(path).expanduser()
    if local.exists():
        return local
    text = os.fspath(path)
    name = parse_model_name(text)
    if name is None:
        raise ModelLoadError(
            f"{kind} {text} does not exist; pass a model directory, a .gguf file or a Hugging "
            "Face hub name (org/name[@revision])"
        )
    from huggingface_hub import hf_hub_download, snapshot_download

    if name.filename:
        with _hub_errors(text, name, "model", ModelLoadError):
            return Path(hf_hub_download(name.repo_id, name.filename, revision=name.revision))
    with _hub_errors(text, name, "model", ModelLoadError):
        snapshot = Path(
            snapshot_download(
                name.repo_id,
                revision=name.revision,
                allow_patterns=MODEL_PATTERNS,
                ignore_patterns=["*/*"],  # subfolders hold other formats (onnx/, original/, ...)
            )
        )
    if any(snapshot.glob("*.safetensors")):
        return snapshot
    from rewardax.models.hf import conversion_command

    files = _repo_files(name, snapshot, "model")
    ggufs = [f for f in files if f.endswith(".gguf")]
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    if ggufs:
        raise ModelLoadError(
            f"{text}: the repo holds GGUF files ({', '.join(ggufs[:4])}) and no safetensors; name "
            f"one, e.g. {name.repo_id}/{ggufs[0]}" + (f"@{name.revision}" if name.revision else "")
        )
    if pickles:
        raise ModelLoadError(
            f"{text}: the repo has only PyTorch pickle weights ({', '.join(pickles[:4])}); rewardax "
            "never downloads or unpickles them (arbitrary code execution). Convert once on a "
            f"machine with torch: {conversion_command(Path(name.repo_id))}, and pass that directory"
        )
    raise ModelLoadError(f"{text}: the repo has no *.safetensors weights (looked in {snapshot})")


def _pick_split(name: HubName, splits: list[str], default_split: str) -> str:
    wanted = name.split.split("[")[0] if name.split else None
    listed = ", ".join(splits) or "none"
    if wanted is not None:
        if wanted not in splits:
            raise DataError(
                f"hub dataset {name.repo_id} has no split {wanted!r}; its splits: {listed}"
            )
        return name.split
    if default_split in splits:
        return default_split
    if len(splits) == 1:
        return splits[0]
    example = f"{name.repo_id}:{splits[0]}" if splits else name.repo_id
    raise DataError(
        f"hub dataset {name.repo_id} has no {default_split!r} split; name one of {listed}, "
        f"e.g. {example}"
    )


def load_hub_dataset(text: str, default_split: str = "train") -> Any:
    """The ``datasets.Dataset`` of a hub dataset name (``org/name[:split][@revision]``).

    Args:
      text: the name (see the module docstring); not an existing local path.
      default_split: the split read when `text` names none ("train" for training, "test" for eval).

    Raises:
      DataError: `text` is no hub dataset name, the repo is not in the cache (offline) or not on
        the hub, it has no such split, or its files cannot be read.
    """
    name = parse_dataset_name(text)
    if name is None:
        raise DataError(f"{text} is neither a local path nor a hub dataset name (org/name[:split])")
    import datasets
    from huggingface_hub import snapshot_download

    with _hub_errors(text, name, "dataset", DataError):
        snapshot = snapshot_download(
            name.repo_id,
            repo_type="dataset",
            revision=name.revision,
            allow_patterns=DATA_PATTERNS,
        )
    unreadable = (FileNotFoundError, ValueError, datasets.exceptions.DatasetsError)
    try:
        builder = datasets.load_dataset_builder(snapshot)
    except unreadable as exc:
        raise _unreadable(name, snapshot, exc) from None
    split = _pick_split(name, [str(s) for s in builder.config.data_files or {}], default_split)
    try:
        builder.download_and_prepare()
        return builder.as_dataset(split=split)
    except unreadable as exc:
        raise _unreadable(name, snapshot, exc) from None


def _unreadable(name: HubName, snapshot: str, exc: Exception) -> DataError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DataError(
        f"hub dataset {name} (cached at {snapshot}): datasets cannot read it ({first})"
    )
