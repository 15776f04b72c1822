"""Where rows come from: files, Hugging Face datasets, python lists, streams.

A random-access source has `len(source)`, `source[i] -> dict` and `source.where(i) -> str` (how error
messages name row i, e.g. `data/train.jsonl:18 (row 17)`); it is picklable, so Grain workers read it.
A stream (`StreamSource`) only iterates.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rewardax.data.formats import InvalidRow
from rewardax.errors import DataError

FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".arrow", ".csv")


def _expand(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    files: list[str] = []
    for item in items:
        text = os.fspath(item)
        if os.path.isdir(text):
            found = sorted(
                os.path.join(root, f)
                for root, _, names in os.walk(text)
                for f in names
                if f.endswith(FILE_SUFFIXES)
            )
            if not found:
                raise DataError(f"directory {text} holds no data file ({', '.join(FILE_SUFFIXES)})")
            files += found
        elif any(ch in text for ch in "*?["):
            found = sorted(glob.glob(text, recursive=True))
            if not found:
                raise DataError(f"no file matches the pattern {text}")
            files += found
        elif os.path.isfile(text):
            files.append(text)
        else:
            raise DataError(f"data file {text} does not exist")
    for f in files:
        if not f.endswith(FILE_SUFFIXES):
            raise DataError(
                f"{f}: unknown data file type; expected one of {', '.join(FILE_SUFFIXES)}"
            )
    return files


class _File:
    """One file's rows; loaded lazily in each process (the loaded data is not pickled)."""

    def __init__(self, path: str):
        self.path = path
        self._rows: Any = None
        self._offsets: np.ndarray | None = None  # jsonl: byte offset of each non-blank line
        self._lines: np.ndarray | None = None  # jsonl: 1-based line number of each row
        self.length = self._scan()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rows": None}

    def _scan(self) -> int:
        if self.path.endswith((".jsonl", ".ndjson")):
            # Line by line (not the whole file at once): memory stays flat for any file size.
            offsets, lines, position = [], [], 0
            with open(self.path, "rb") as fh:
                for number, line in enumerate(fh, start=1):
                    if line.strip():
                        offsets.append(position)
                        lines.append(number)
                    position += len(line)
            self._offsets = np.asarray(offsets, dtype=np.int64)
            self._lines = np.asarray(lines, dtype=np.int64)
            return len(lines)
        if self.path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).metadata.num_rows
        return len(self._load())

    def _load(self) -> Any:
        if self._rows is not None:
            return self._rows
        if self.path.endswith(".json"):
            with open(self.path, encoding="utf-8") as fh:
                try:
                    rows = json.load(fh)
                except json.JSONDecodeError as err:
                    raise DataError(
                        f"{self.path}:{err.lineno}: not valid JSON ({err.msg}); a .json file must hold a "
                        "list of row objects (use .jsonl for one object per line)"
                    ) from None
            if not isinstance(rows, list):
                raise DataError(
                    f"{self.path}: expected a JSON list of row objects, got {type(rows).__name__}"
                )
            self._rows = rows
        elif self.path.endswith(".parquet"):
            import pyarrow.parquet as pq

            self._rows = pq.read_table(self.path, memory_map=True)
        elif self.path.endswith(".arrow"):
            import pyarrow as pa

            try:
                self._rows = pa.ipc.open_file(pa.memory_map(self.path)).read_all()
            except pa.ArrowInvalid:  # `datasets` writes the streaming format
                self._rows = pa.ipc.open_stream(pa.memory_map(self.path)).read_all()
        elif self.path.endswith(".csv"):
            import pyarrow.csv as pcsv

            try:
                self._rows = pcsv.read_csv(self.path)
            except Exception as err:  # pyarrow raises ArrowInvalid with the line in its text
                raise DataError(f"{self.path}: cannot read as CSV: {err}") from None
        return self._rows

    def row(self, i: int) -> Any:
        if self._offsets is not None:
            with open(self.path, "rb") as fh:
                fh.seek(int(self._offsets[i]))
                line = fh.readline()
            try:
                return json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise InvalidRow("malformed_json", "<line>", f"not valid JSON ({err})") from None
        rows = self._load()
        if isinstance(rows, list):
            return rows[i]
        return rows.slice(i, 1).to_pylist()[0]

    def line(self, i: int) -> int | None:
        return int(self._lines[i]) if self._lines is not None else None


class ShardedDataSource:
    """Rows of one or more files (jsonl / ndjson / json / parquet / arrow / csv), in file order.

    Args:
      paths: a file, a directory (searched recursively), a glob, or a list of those.
    Example: `ShardedDataSource("data/*.jsonl")[0] -> {"chosen": ..., "rejected": ...}`.
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
        self.files = [_File(p) for p in _expand(paths)]
        self._ends = np.cumsum([f.length for f in self.files])

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def _locate(self, index: int) -> tuple[_File, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        k = int(np.searchsorted(self._ends, index, side="right"))
        start = int(self._ends[k - 1]) if k else 0
        return self.files[k], index - start

    def __getitem__(self, index: int) -> Any:
        file, i = self._locate(int(index))
        return file.row(i)

    def where(self, index: int) -> str:
        if len(self) == 0:  # an empty source still names its files in errors
            return ", ".join(str(f.path) for f in self.files) or "<no files>"
        file, i = self._locate(int(index))
        line = file.line(i)
        return f"{file.path}:{line} (row {i})" if line is not None else f"{file.path} (row {i})"


class ListSource:
    """A python sequence of row dicts."""

    def __init__(self, rows: Sequence[Any], name: str = "rows"):
        self.rows, self.name = rows, name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[int(index)]

    def where(self, index: int) -> str:
        return f"{self.name}[{index}]"


class HFDatasetSource(ListSource):
    """A Hugging Face `datasets.Dataset` (memory-mapped; rows are read one at a time)."""

    def __init__(self, dataset: Any, name: str | None = None):
        if name is None:
            info = getattr(dataset, "info", None)
            name = f"dataset {(info and info.dataset_name) or ''}".strip()
        super().__init__(dataset, name=name)

    def where(self, index: int) -> str:
        return f"{self.name} row {index}"


class StreamSource:
    """An iterable of rows without random access (a `datasets.IterableDataset`, a generator factory).

    `rows(epoch, seed, shuffle)` iterates one epoch; IterableDatasets are shuffled with their own
    buffered shuffle, reseeded per epoch.
    """

    def __init__(self, iterable: Iterable[Any] | Callable[[], Iterable[Any]], name: str = "stream"):
        self.iterable, self.name = iterable, name

    def rows(self, epoch: int, seed: int, shuffle: bool) -> Iterator[Any]:
        data = (
            self.iterable()
            if callable(self.iterable) and not hasattr(self.iterable, "__iter__")
            else self.iterable
        )
        if shuffle and hasattr(data, "shuffle") and hasattr(data, "set_epoch"):
            data = data.shuffle(seed=seed, buffer_size=10_000)
            data.set_epoch(epoch)
        return iter(data)

    def where(self, index: int) -> str:
        return f"{self.name} row {index}"


def load_source(
    source: Any, *, default_split: str = "train"
) -> ShardedDataSource | ListSource | StreamSource:
    """Any supported input -> a source.

    Accepts: a ShardedDataSource / ListSource / StreamSource (returned as is), a `datasets.Dataset`, a
    `datasets.IterableDataset`, a path / glob / directory (str or Path), a list of paths, a list of
    row dicts, or a Hugging Face hub dataset name `org/name[:split][@revision]` (a str that is not
    an existing path; see `rewardax.hub`), read at `default_split` when it names no split.
    """
    if isinstance(source, ShardedDataSource | ListSource | StreamSource):
        return source
    if isinstance(source, str) and not os.path.exists(source):
        from rewardax import hub

        if hub.parse_dataset_name(source) is not None:
            return HFDatasetSource(
                hub.load_hub_dataset(source, default_split), name=f"hub dataset {source}"
            )
    if isinstance(source, str | Path):
        return ShardedDataSource(source)
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None:
        if isinstance(source, datasets.Dataset):
            return HFDatasetSource(source)
        if isinstance(source, datasets.IterableDataset):
            return StreamSource(source, name="iterable dataset")
        if isinstance(source, datasets.DatasetDict | datasets.IterableDatasetDict):
            raise DataError(
                f"got a DatasetDict with splits {list(source)}; pass one split, e.g. ds['train']"
            )
    if isinstance(source, list | tuple):
        if source and all(isinstance(x, str | Path) for x in source):
            return ShardedDataSource(list(source))
        return ListSource(source)
    raise DataError(
        f"cannot read training data from a {type(source).__name__}; pass a datasets.Dataset, an "
        "IterableDataset, a ShardedDataSource, a file path / glob / directory, or a list of row dicts"
    )


as_data_source = load_source


def load_eval_sources(source: Any) -> dict[str, Any]:
    """Eval data as named sources: a dict of sets keeps its names, anything else is named 'eval'.
    A hub dataset name without a split reads its `test` split."""
    if isinstance(source, dict) and not any(
        k in source for k in ("chosen", "rejected", "chosen_input_ids")
    ):
        return {
            str(name): load_source(value, default_split="test") for name, value in source.items()
        }
    return {"eval": load_source(source, default_split="test")}
