"""Batching across requests: an asyncio queue gathered into length-bucketed forward passes.

Each request's rows are encoded in one worker thread (the tokenizer is not shared between
threads), queued with a future, and a single gathering task takes what is queued, waits up to
`max_wait_s` for more while the batch holds fewer than `max_batch_tokens` padded tokens (longer
when it holds under a quarter of the last pass's rows: the clients that pass answered are coming
back), runs the model in another thread (the event loop keeps accepting requests meanwhile) and
resolves each future with its own rows' rewards (and, for a multi-objective model, every
objective's output), in order. Admission is bounded in rows: past `max_queue_rows`
waiting or running, a request is refused (`QueueFull`, answered 503 with Retry-After), so memory
stays bounded whatever the load.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

# The longest a small batch waits for the clients of the last pass to come back.
CATCH_UP_MAX_S = 0.25


class QueueFull(Exception):
    """More rows are waiting than the queue admits."""


class Scored(NamedTuple):
    """A request's rows scored, in order."""

    rewards: list[float]
    objectives: np.ndarray | None  # float64 [rows, objectives]; None for a single-output model
    tokens: int


@dataclass
class _Item:
    sequences: list[np.ndarray]
    cost: int  # padded tokens
    future: asyncio.Future = field(repr=False)


class Batcher:
    """Gathers rows of concurrent requests into batches for a `ServingModel`.

    Args:
      model: a `ServingModel` (encode, score, bucket_of).
      max_batch_tokens: stop gathering once a batch holds this many padded tokens.
      max_wait_s: the longest a gathered batch waits for more requests.
      max_queue_rows: rows admitted (queued or running) at once; more are refused.

    Use `start()` inside the running event loop, `await score(rows)`, then `await stop()`.
    """

    def __init__(
        self, model: Any, *, max_batch_tokens: int, max_wait_s: float, max_queue_rows: int
    ):
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue_rows = max_queue_rows
        self.admitted_rows = 0
        self.stats = {"requests": 0, "rows": 0, "batches": 0}
        self._encode_pool = ThreadPoolExecutor(1, thread_name_prefix="rewardax-encode")
        self._model_pool = ThreadPoolExecutor(1, thread_name_prefix="rewardax-model")
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task | None = None
        self._last_rows, self._last_pass_s = 0, 0.0  # the last forward pass: rows, seconds

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._gather_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._encode_pool.shutdown(wait=True)
        self._model_pool.shutdown(wait=True)

    async def score(self, rows: list[Any]) -> Scored:
        """`rows` scored (rewards, objective outputs, token count); QueueFull when the queue is
        full, DataError for a bad row."""
        if self.admitted_rows + len(rows) > self.max_queue_rows:
            raise QueueFull
        self.admitted_rows += len(rows)
        try:
            loop = asyncio.get_running_loop()
            sequences = await loop.run_in_executor(self._encode_pool, self.model.encode, rows)
            cost = sum(self.model.bucket_of(len(s)) for s in sequences)
            item = _Item(sequences, cost, loop.create_future())
            self._queue.put_nowait(item)
            rewards, objectives = await item.future
        finally:
            self.admitted_rows -= len(rows)
        self.stats["requests"] += 1
        self.stats["rows"] += len(rows)
        return Scored(rewards, objectives, sum(len(s) for s in item.sequences))

    async def _gather_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            rows, tokens = len(batch[0].sequences), batch[0].cost
            # A pass answers many clients at once and they come back one by one, a few ms
            # apart. A batch under a quarter of the last pass's rows waits for them (until it is
            # as large, for a quarter of that pass's time and at most CATCH_UP_MAX_S) instead of
            # running alone and splitting the clients into a large and a tiny pass ever after.
            catch_up = 4 * rows <= self._last_rows
            wait = min(self._last_pass_s / 4, CATCH_UP_MAX_S) if catch_up else 0.0
            cutoff = loop.time() + max(wait, self.max_wait_s)
            while tokens < self.max_batch_tokens:
                if self._queue.empty():
                    timeout = cutoff - loop.time()
                    if timeout <= 0 or (catch_up and rows >= self._last_rows):
                        break
                    try:
                        item = await asyncio.wait_for(self._queue.get(), timeout)
                    except TimeoutError:
                        break
                else:
                    item = self._queue.get_nowait()
                batch.append(item)
                rows += len(item.sequences)
                tokens += item.cost
            await self._run(batch)

    async def _run(self, batch: list[_Item]) -> None:
        sequences = [s for item in batch for s in item.sequences]
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            rewards, objectives = await loop.run_in_executor(
                self._model_pool, self.model.score, sequences
            )
        except Exception as error:  # handed to each waiting request, which answers 500
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            return
        self.stats["batches"] += 1
        self._last_rows, self._last_pass_s = len(sequences), loop.time() - start
        start = 0
        for item in batch:
            end = start + len(item.sequences)
            if not item.future.done():  # a request cancelled meanwhile
                own = None if objectives is None else objectives[start:end]
                item.future.set_result(([float(r) for r in rewards[start:end]], own))
            start = end
