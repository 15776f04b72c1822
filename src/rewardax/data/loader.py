"""The training iterator (`PreferenceLoader`) and the eval iterator (`iterate_eval_batches`).

Rows are read, normalised and tokenized lazily as the iterator advances: a Grain pipeline over
chunks of rows (`MapDataset.range(chunks).map(read + tokenize a chunk)`, prefetched in `num_workers`
processes, or one thread) yields packed records; the main process groups them by length in windows
and collates batches.

The resume state is ours, not Grain's: the flat row position where the current window started, how
many of its batches were already handed out, and the statistics. A restored loader rebuilds the
pipeline from that position, so it continues at the exact next row even with another worker count.

Over 500 lines: the training and eval iterators share the reading, grouping and statistics code
that an exact resume depends on.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grain
import numpy as np

from rewardax.data.batching import epoch_order, group_by_length, process_rows, window_rows
from rewardax.data.collate import (
    RowProcessor,
    collate_records,
    default_bucket_lengths,
    raise_or_none,
)
from rewardax.data.config import DataConfig
from rewardax.data.formats import InvalidRow, detect_dataset_format
from rewardax.data.groups import GroupProcessor, collate_groups, pack_group_records
from rewardax.data.packing import (
    group_row_lengths,
    pack_microbatches,
    pack_records,
    packing_row_lengths,
    token_counts,
)
from rewardax.data.rankings import ResponseGroups, training_view
from rewardax.data.sources import StreamSource, load_source
from rewardax.data.tokenize import pad_token_id
from rewardax.errors import CheckpointError, ConfigError, DataError

_STATE_VERSION = 1
# Rows per Grain element: one tokenizer call and one inter-process message per chunk.
_CHUNK_ROWS = 128


@dataclass
class LoaderStats:
    """What the loader did so far (per process).

    rows_read: source rows pulled; pairs_seen: real pairs (group rows, with a group loss) handed
    out in batches; dropped: skipped or
    filtered rows by reason; truncated: pairs with a cut sequence; real_tokens / computed_tokens:
    attention-mask ones vs B*2*T over handed-out batches.
    """

    rows_read: int = 0
    pairs_seen: int = 0
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    real_tokens: int = 0
    computed_tokens: int = 0

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / computed tokens (1.0 = no padding)."""
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "dropped": dict(self.dropped),
            "padding_efficiency": self.padding_efficiency,
        }


class _ReadChunk:
    """Chunk c -> the packed records of flat positions [start + c*rows, ...); runs in Grain workers.

    Flat position k is row slot k % n of epoch k // n (n = this process's rows per epoch). A chunk
    of rows is one Grain element: the tokenizer gets one call per chunk, and a worker sends back a
    few numpy arrays per chunk instead of a dict per row.
    """

    def __init__(
        self,
        source: Any,
        processor: RowProcessor,
        seed: int,
        shuffle: bool,
        pi: int,
        pc: int,
        start: int,
        end: int,
        rows: int,
    ):
        self.source, self.processor = source, processor
        self.seed, self.shuffle, self.pi, self.pc = seed, shuffle, pi, pc
        self.start, self.end, self.rows = start, end, rows
        self.local = process_rows(len(source), pi, pc)
        self._epoch, self._order = -1, None

    def _index(self, k: int) -> tuple[int, int]:
        epoch, slot = divmod(k, self.local)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = epoch_order(len(self.source), self.seed, epoch, self.shuffle)
        return epoch, int(self._order[self.pi + slot * self.pc])

    def __call__(self, c: int) -> dict:
        first = self.start + int(c) * self.rows
        last = min(first + self.rows, self.end)
        epochs, indices, rows, slots = [], [], [], []
        records: list[dict | None] = [None] * (last - first)
        for j, k in enumerate(range(first, last)):
            epoch, index = self._index(k)
            epochs.append(epoch)
            indices.append(index)
            try:
                rows.append(self.source[index])
                slots.append(j)
            except InvalidRow as bad:
                records[j] = {
                    "dropped": bad.reason,
                    "fatal": True,
                    "index": index,
                    "message": f"{self.source.where(index)}: {bad.expected}. Fix the line, or set "
                    "data.on_invalid=skip.",
                }
        processed = self.processor.process_many(
            rows, [indices[j] for j in slots], self.source.where
        )
        for j, record in zip(slots, processed, strict=True):
            records[j] = record
        return _pack(first, epochs, records)


def _pack(first: int, epochs: list[int], records: list[dict | None]) -> dict:
    """Records of a chunk as a few arrays (cheap to send between processes).

    Returns: first (flat position of row 0), epoch int64 [n], index int64 [n], lengths int32 [n, 2]
    (chosen, rejected; 0 for dropped rows), ids int32 [sum of lengths] (chosen then rejected, row
    after row), margin float32 [n], truncated bool [n], drops {row: (reason, fatal, message)}.
    Group records (`rewardax.data.groups`) have lengths [n, K] (0 past a row's responses) and
    targets float32 [n, K] (named scores: [n, K, L]) instead of margin.
    """
    n = len(records)
    kept = [r for r in records if "dropped" not in r]
    group = any("responses" in r for r in kept)
    width = max((len(r["responses"]) for r in kept), default=1) if group else 2
    lengths = np.zeros((n, width), dtype=np.int32)
    margin = np.zeros((n,), dtype=np.float32)
    # Named scores: [K_i, L] targets per record (NaN = not scored) -> [n, K, L].
    extra = next((np.shape(r["targets"])[1:] for r in kept if group), ())
    targets = np.zeros((n, width, *extra), dtype=np.float32)
    truncated = np.zeros((n,), dtype=bool)
    index = np.zeros((n,), dtype=np.int64)
    pieces, drops = [], {}
    for j, r in enumerate(records):
        index[j] = r["index"]
        if "dropped" in r:
            drops[j] = (r["dropped"], bool(r["fatal"]), r["message"])
            continue
        if group:
            sequences = r["responses"]
            targets[j, : len(sequences)] = r["targets"]
        else:
            sequences = (r["chosen_input_ids"], r["rejected_input_ids"])
            margin[j] = r["margin"]
        lengths[j, : len(sequences)] = [len(x) for x in sequences]
        truncated[j] = r["truncated"]
        pieces += sequences
    chunk = {
        "first": first,
        "epoch": np.asarray(epochs, dtype=np.int64),
        "index": index,
        "lengths": lengths,
        "ids": np.concatenate(pieces) if pieces else np.zeros((0,), np.int32),
        "margin": margin,
        "truncated": truncated,
        "drops": drops,
    }
    if group:
        chunk["targets"] = targets
    return chunk


def _unpack(chunk: dict) -> Iterator[tuple[int, int, dict]]:
    """(flat position of the row, epoch, record) for each row of a packed chunk, in order."""
    ids, lengths, drops = chunk["ids"], chunk["lengths"], chunk["drops"]
    ends = np.cumsum(lengths.reshape(-1)).tolist()
    margin, truncated = chunk["margin"].tolist(), chunk["truncated"].tolist()
    index, epochs = chunk["index"].tolist(), chunk["epoch"].tolist()
    start = 0
    for j in range(len(index)):
        if j in drops:
            reason, fatal, message = drops[j]
            record = {"dropped": reason, "fatal": fatal, "message": message, "index": index[j]}
        elif "targets" in chunk:  # a group record: its responses are the nonzero lengths
            width = lengths.shape[1]
            k = int(np.count_nonzero(lengths[j]))
            bounds = [start, *ends[width * j : width * j + k]]
            record = {
                "responses": [ids[a:b] for a, b in itertools.pairwise(bounds)],
                "targets": chunk["targets"][j, :k],
                "truncated": truncated[j],
                "index": index[j],
            }
            start = ends[width * j + width - 1]
        else:
            mid, end = ends[2 * j], ends[2 * j + 1]
            record = {
                "chosen_input_ids": ids[start:mid],
                "rejected_input_ids": ids[mid:end],
                "margin": margin[j],
                "truncated": truncated[j],
                "index": index[j],
            }
            start = end
        yield chunk["first"] + j, epochs[j], record


class PreferenceLoader:
    """Iterable of training batches (format: `rewardax.data.collate`), resumable.

    Args:
      source: anything `load_source` accepts.
      tokenizer: a Hugging Face tokenizer.
      data_config: the `data` settings.
      batch_size: pairs per batch for this process (the global batch / process_count).
      seed: seeds the per-epoch shuffle and the batch order inside length windows.
      process_index / process_count: this process reads rows i with i % count == index of each epoch.
      num_epochs: None repeats forever.
      drop_remainder: drop an epoch's last partial batch (counted as `remainder`); else pad it with
        pair_mask 0.
      eval_mode: no shuffle (deterministic order), never drop a partial batch; always the padded
        layout, whatever `data_config.layout` says.
      row_multiple: with a packed layout, the row count R of every batch is a multiple of this
        (the data-parallel size, so rows split evenly over devices).
      microbatches: with a packed layout, each batch is this many microbatches packed on their
        own (`packing.pack_microbatches`), for a train step that accumulates gradients over as
        many (train.gradient_accumulation_steps); batch_size must divide by it.
      loss: the training loss (`train.loss`): `bradley_terry` reads pairs (rows ranking several
        responses as the pairs they imply); a group loss reads groups of K responses
        (`rankings.training_view`: DataError when the data does not fit the loss) and yields
        `rewardax.data.groups` batches, always in the padded layout.
      max_responses: with a group loss, the most responses a row may have (None: no cap).
      objectives: model.objectives: score rows carry named scores (`rankings.named_scores`),
        batches `scores` [B, 1, L] and `score_mask`.

    Example:
      loader = PreferenceLoader("train.jsonl", tok, DataConfig(max_sequence_length=256), batch_size=8, seed=0)
      batch = next(iter(loader))          # batch["input_ids"].shape == (8, 2, T), T in the buckets
      state = loader.get_state()          # JSON-serialisable; loader2.set_state(state) resumes
    """

    def __init__(
        self,
        source: Any,
        tokenizer: Any,
        data_config: DataConfig,
        *,
        batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        num_epochs: int | None = None,
        drop_remainder: bool = True,
        eval_mode: bool = False,
        row_multiple: int = 1,
        loss: str = "bradley_terry",
        max_responses: int | None = None,
        objectives: list[str] | None = None,
        microbatches: int = 1,
    ):
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= process_index < process_count:
            raise ConfigError(f"process_index {process_index} is outside 0..{process_count - 1}")
        if data_config.on_invalid not in ("error", "skip"):
            raise ConfigError(
                f"data.on_invalid must be 'error' or 'skip', got {data_config.on_invalid!r}"
            )
        # Rows that rank several responses are read as the pairs of their rankings, or as groups.
        self.source = training_view(load_source(source), loss, max_responses, objectives)
        self.groups = isinstance(self.source, ResponseGroups)
        if self.groups and data_config.layout == "packed" and not eval_mode:
            raise ConfigError(
                f"train.loss={loss} lays out groups of K responses with data.layout=padded or "
                "shared_prompt (the prompt once, K branches), not packed"
            )
        self.config = data_config
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.process_index, self.process_count = process_index, process_count
        self.num_epochs, self.eval_mode = num_epochs, eval_mode
        self.drop_remainder = drop_remainder and not eval_mode
        self.shuffle = data_config.shuffle and not eval_mode
        self.pad_id = pad_token_id(tokenizer)
        self.buckets = default_bucket_lengths(
            data_config.max_sequence_length,
            data_config.bucket_lengths,
            data_config.buckets_per_octave,
        )
        self.layout = "padded" if eval_mode else data_config.layout
        # Packed layouts fill rows better with mixed lengths, and their per-batch token totals then
        # vary less (fewer distinct shapes): no length grouping for them.
        window = data_config.length_group_window if self.layout == "padded" else 1
        self.window = window_rows(self.batch_size, window)
        self.row_multiple = max(int(row_multiple), 1)
        # Padded batches are split by the step as they are: microbatches matter to packing only.
        self.microbatches = 1 if self.layout == "padded" else int(microbatches)
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ConfigError(
                f"batch_size={batch_size} must divide into microbatches={microbatches} (≥ 1)"
            )
        self.row_lengths = packing_row_lengths(data_config)
        self.streaming = isinstance(self.source, StreamSource)
        if self.groups:
            fmt = None  # every row was checked by the view
            if len(self.source) == 0:
                raise DataError(f"{self.source.name}: the dataset has no rows")
        elif self.streaming:
            fmt = None  # detected per row
        else:
            if len(self.source) == 0:
                raise DataError(f"{self.source.where(0).split(' ')[0]}: the dataset has no rows")
            probe = []
            for i in range(min(16, len(self.source))):
                try:
                    probe.append(self.source[i])
                except InvalidRow:
                    continue
            fmt = detect_dataset_format(probe)
        self.dataset_format = fmt
        if (
            fmt in ("conversational", "sharegpt")
            and getattr(tokenizer, "chat_template", None) is None
        ):
            raise ConfigError(
                f"the data is {fmt} but the tokenizer has no chat template; set one on the tokenizer"
            )
        if self.groups:
            self.processor = GroupProcessor(tokenizer, data_config, self.source.layout)
        else:
            self.processor = RowProcessor(tokenizer, data_config, fmt)
        self.local_rows = (
            None if self.streaming else process_rows(len(self.source), process_index, process_count)
        )
        self._state: dict = {"position": 0, "batches_done": 0}
        self.stats = LoaderStats()

    # -- state ------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        return {
            "rows": None if self.streaming else len(self.source),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "process_index": self.process_index,
            "process_count": self.process_count,
            "window": self.window,
            "shuffle": self.shuffle,
        }

    def get_state(self) -> dict:
        """JSON-serialisable position after the last batch handed out, with the statistics."""
        return {
            "version": _STATE_VERSION,
            **self._state,
            "stats": self.stats.as_dict(),
            "config": self._fingerprint(),
        }

    def set_state(self, state: dict) -> None:
        """Continue after the batch at which `state` was taken (same data, seed, batch size)."""
        if state.get("version") != _STATE_VERSION:
            raise CheckpointError(
                f"data iterator state version {state.get('version')} is not {_STATE_VERSION}"
            )
        mine = self._fingerprint()
        diff = {
            k: (state["config"].get(k), v) for k, v in mine.items() if state["config"].get(k) != v
        }
        if diff:
            raise CheckpointError(
                f"the data iterator state was saved with other settings (saved, now): {diff}; resume with "
                "the same data, seed, batch size and process layout"
            )
        self._state = {
            "position": int(state["position"]),
            "batches_done": int(state["batches_done"]),
        }
        saved = state["stats"]
        self.stats = LoaderStats(
            rows_read=saved["rows_read"],
            pairs_seen=saved["pairs_seen"],
            truncated=saved["truncated"],
            dropped=dict(saved["dropped"]),
            real_tokens=saved["real_tokens"],
            computed_tokens=saved["computed_tokens"],
        )

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        if self.streaming:
            return int(self._state.get("epoch", 0))
        return self._state["position"] // max(self.local_rows, 1)

    # -- reading ------------------------------------------------------------------------------
    def _records(self, start: int) -> Iterator[dict]:
        """Records from flat position `start` on, each with its epoch and the position after it."""
        if self.streaming:
            yield from self._stream_records(start)
            return
        end = (1 << 50) if self.num_epochs is None else self.num_epochs * self.local_rows
        if start >= end or self.local_rows == 0:
            return
        rows = _CHUNK_ROWS
        task = _ReadChunk(
            self.source,
            self.processor,
            self.seed,
            self.shuffle,
            self.process_index,
            self.process_count,
            start,
            end,
            rows,
        )
        dataset = grain.MapDataset.range(-(-(end - start) // rows)).map(task)
        workers = self.config.num_workers
        # Chunks are read ahead by one Grain thread (the tokenizer releases the GIL) or by the
        # workers, up to one length-group window plus a chunk: the next window is tokenized while
        # the training step consumes this one, so a window boundary does not stall the step.
        ahead = -(-self.window // rows) + 1
        iterable = dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0 if workers else 1, prefetch_buffer_size=ahead)
        )
        if workers > 0:
            from absl import flags

            # Grain's worker processes read absl flags; outside an absl app nobody parses them.
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            iterable = iterable.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=workers, per_worker_buffer_size=-(-ahead // workers)
                )
            )
        iterator = iter(iterable)
        try:
            for chunk in iterator:
                for k, epoch, record in _unpack(chunk):
                    record["epoch"] = epoch
                    record["position"] = k + 1
                    record["epoch_end"] = (k + 1) % self.local_rows == 0
                    yield record
        finally:
            if hasattr(iterator, "close"):
                iterator.close()

    def _stream_records(self, start: int) -> Iterator[dict]:
        # Streams: position counts rows of this process over all epochs; epochs end when the stream
        # does. Rows are tokenized in chunks, like the random-access path.
        position, epoch = 0, 0
        while self.num_epochs is None or epoch < self.num_epochs:
            produced = False
            pending: list[tuple[int, Any, int]] = []  # (row number, row, position)
            last = None
            for k, row in enumerate(self.source.rows(epoch, self.seed, self.shuffle)):
                if k % self.process_count != self.process_index:
                    continue
                position += 1
                produced = True
                if position <= start:
                    continue
                pending.append((k, row, position))
                if len(pending) == _CHUNK_ROWS:
                    if last is not None:
                        yield last
                    *done, last = self._process_stream(pending, epoch)
                    yield from done
                    pending = []
            if pending:
                if last is not None:
                    yield last
                *done, last = self._process_stream(pending, epoch)
                yield from done
            if last is not None:
                last["epoch_end"] = True
                yield last
            if not produced:
                return
            epoch += 1

    def _process_stream(self, pending: list[tuple[int, Any, int]], epoch: int) -> list[dict]:
        records = self.processor.process_many(
            [row for _, row, _ in pending], [k for k, _, _ in pending], self.source.where
        )
        for record, (_, _, position) in zip(records, pending, strict=True):
            record.update(epoch=epoch, position=position, epoch_end=False)
        return records

    def _batches(self) -> Iterator[tuple[dict, dict]]:
        """(batch, state after it) pairs from the current state on."""
        start, skip = self._state["position"], self._state["batches_done"]
        # Counts travel with each batch and are added when it is handed out, so the statistics in
        # get_state() never run ahead of the consumer (batches are built ahead by the prefetcher).
        stats = LoaderStats()
        counting = skip == 0
        state = dict(self._state)
        records = self._records(start)
        window_start = start
        pending = next(records, None)
        while pending is not None:
            valid: list[dict] = []
            epoch = pending["epoch"]
            epoch_done = False
            while pending is not None and len(valid) < self.window:
                record, pending = pending, next(records, None)
                end_position = record["position"]
                epoch_done = record["epoch_end"]
                kept = raise_or_none(record, self.config.on_invalid)
                if counting:
                    stats.rows_read += 1
                    if kept is None:
                        stats.dropped[record["dropped"]] = (
                            stats.dropped.get(record["dropped"], 0) + 1
                        )
                if kept is not None:
                    valid.append(kept)
                if epoch_done:
                    break
            rng = (
                np.random.default_rng([self.seed, epoch, window_start, 0xB47C])
                if self.shuffle
                else None
            )
            groups = group_by_length(valid, self.batch_size, rng)
            if groups and len(groups[-1]) < self.batch_size and self.drop_remainder:
                if counting:
                    stats.dropped["remainder"] = stats.dropped.get("remainder", 0) + len(groups[-1])
                groups = groups[:-1]
            for b, group in enumerate(groups):
                if b < skip:
                    continue
                batch = self._collate(group)
                if self.eval_mode:
                    batch["row_index"] = np.full((self.batch_size,), -1, dtype=np.int32)
                    batch["row_index"][: len(group)] = [r["index"] for r in group]
                stats.pairs_seen += len(group)
                stats.truncated += sum(r["truncated"] for r in group)
                real, computed = token_counts(batch)
                stats.real_tokens += real
                stats.computed_tokens += computed
                last = b == len(groups) - 1
                state = (
                    {"position": end_position, "batches_done": 0}
                    if last
                    else {"position": window_start, "batches_done": b + 1}
                )
                if self.streaming:
                    state["epoch"] = epoch + (1 if last and epoch_done else 0)
                yield batch, state, stats
                stats = LoaderStats()
            skip, counting = 0, True
            window_start = end_position
            # A window that handed out nothing (all rows dropped) still moves the position.
            state = {"position": end_position, "batches_done": 0}
            if self.streaming:
                state["epoch"] = epoch + (1 if epoch_done else 0)
        yield None, state, stats  # rows read after the last batch (dropped ones, a remainder)

    def _collate(self, group: list[dict]) -> dict[str, np.ndarray]:
        if self.layout == "padded":
            if self.groups:
                return collate_groups(
                    group,
                    self.pad_id,
                    self.buckets,
                    self.batch_size,
                    self.source.width,
                    self.source.target_name,
                    len(self.source.objectives or ()),
                )
            return collate_records(group, self.pad_id, self.buckets, self.batch_size)
        lengths = (
            group_row_lengths(self.config, self.source.width) if self.groups else self.row_lengths
        )
        if self.microbatches > 1:
            return pack_microbatches(self._pack, group, self.microbatches, lengths, self.pad_id)
        return self._pack(group, lengths)

    def _pack(self, records: list[dict], row_lengths: Sequence[int]) -> dict[str, np.ndarray]:
        """``records`` as one packed batch (shared_prompt groups, or packed / shared_prompt
        pairs) of batch_size / microbatches pairs or groups, in rows of one of ``row_lengths``."""
        size = self.batch_size // self.microbatches
        if self.groups:
            return pack_group_records(
                records,
                self.pad_id,
                size,
                self.source.width,
                self.source.target_name,
                row_lengths,
                self.row_multiple,
            )
        return pack_records(
            records,
            self.pad_id,
            layout=self.layout,
            batch_size=size,
            row_lengths=row_lengths,
            row_multiple=self.row_multiple,
        )

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """Batches from the current state on; the state advances as each batch is handed out."""
        depth = self.config.prefetch
        if depth <= 0:
            for batch, state, counts in self._batches():
                self._hand_out(state, counts)
                if batch is not None:
                    yield batch
            return
        yield from self._prefetched(depth)

    def _hand_out(self, state: dict, counts: LoaderStats) -> None:
        self._state = state
        total = self.stats
        for name in ("rows_read", "pairs_seen", "truncated", "real_tokens", "computed_tokens"):
            setattr(total, name, getattr(total, name) + getattr(counts, name))
        for reason, n in counts.dropped.items():
            total.dropped[reason] = total.dropped.get(reason, 0) + n

    def _prefetched(self, depth: int) -> Iterator[dict[str, np.ndarray]]:
        # Batches are built in a thread while the step runs (XLA releases the GIL); each carries the
        # state to record when it is handed out, so get_state() never runs ahead of the consumer.
        box: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()
        done = object()

        def produce() -> None:
            try:
                for item in self._batches():
                    while not stop.is_set():
                        try:
                            box.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                box.put(done)
            except BaseException as err:  # handed to the consumer, raised there
                box.put(err)

        thread = threading.Thread(target=produce, daemon=True, name="rewardax-prefetch")
        thread.start()
        try:
            while True:
                item = box.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, state, counts = item
                self._hand_out(state, counts)
                if batch is not None:
                    yield batch
        finally:
            stop.set()
            thread.join(timeout=5)


def iterate_eval_batches(
    source: Any,
    tokenizer: Any,
    data_config: DataConfig,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    stats: LoaderStats | None = None,
    loss: str = "bradley_terry",
    objectives: list[str] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Every pair of `source` exactly once, in a deterministic order; the last batch padded (pair_mask 0).

    Batches also carry `row_index` int32 [B]: the source row of each pair (-1 for padding pairs).
    With a group `loss`, group batches (`rewardax.data.groups`) of the source's rows instead.
    """
    loader = PreferenceLoader(
        source,
        tokenizer,
        data_config,
        batch_size=batch_size,
        seed=0,
        process_index=process_index,
        process_count=process_count,
        num_epochs=1,
        drop_remainder=False,
        eval_mode=True,
        loss=loss,
        objectives=objectives,
    )
    if stats is not None:
        loader.stats = stats
    yield from loader
