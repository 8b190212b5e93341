"""An async micro-batcher: many concurrent ``await submit(item)`` calls, few batched calls.

The first item of a batch waits at most ``max_wait_ms`` for company; a batch closes early when it
reaches ``max_batch_size``. Each batch is one call of ``fn(items) -> results`` (run as its own
task, so batches overlap); results go back to their waiters in order, and an exception goes to
every waiter of the batch. With ``split_on`` set, a failed batch of several items whose exception
satisfies it is retried item by item, so one bad item fails alone instead of taking its whole
batch down with it (the consumer loop would otherwise dead-letter innocent neighbours).

Closing cancels: a waiter not yet answered, and any later ``submit``, gets ``CancelledError``,
never an error of its own. For the consumer loop that means the entry stays pending for the next
consumer, instead of failing (and at last being dead-lettered) with a reason that only says the
batcher was closed.

Used by the reward service (trajectories -> scorers) and by ``serve-rm`` (texts -> model).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from streamrl.common.aio import cancel_and_wait, wait_set

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """Groups concurrent submissions into batched calls of ``fn``.

    Example:
        batcher = MicroBatcher(score_texts, max_batch_size=32, max_wait_ms=5)
        rewards = await asyncio.gather(*(batcher.submit(t) for t in texts))
    """

    def __init__(
        self,
        fn: Callable[[list[T]], Awaitable[list[R]]],
        max_batch_size: int,
        max_wait_ms: float,
        split_on: Callable[[BaseException], bool] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self._fn = fn
        self._max_batch_size = max_batch_size
        self._max_wait_s = max_wait_ms / 1000.0
        self._split_on = split_on
        self._items: list[tuple[T, asyncio.Future[R]]] = []
        self._arrived = asyncio.Event()
        self._collector: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._closed = False
        self.num_batches = 0
        """Batched calls made so far (split retries not counted)."""
        self.num_items = 0
        """Items submitted so far."""

    async def submit(self, item: T) -> R:
        """Queue ``item`` and wait for its result (or its batch's exception); CancelledError once closed."""
        if self._closed:
            raise asyncio.CancelledError("the micro-batcher is closed: the service is stopping")
        if self._collector is None:
            self._collector = asyncio.create_task(self._collect(), name="micro-batcher")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._items.append((item, future))
        self.num_items += 1
        self._arrived.set()
        return await future

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._items:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = loop.time() + self._max_wait_s
            while len(self._items) < self._max_batch_size:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                if not await wait_set(self._arrived, remaining):
                    break
            batch = [p for p in self._items[: self._max_batch_size] if not p[1].done()]
            del self._items[: self._max_batch_size]
            if batch:
                self.num_batches += 1
                task = asyncio.create_task(self._run(batch))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._fn([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"batched call returned {len(results)} results for {len(batch)} items")
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - handed to every waiter, who re-raises it
            if len(batch) > 1 and self._split_on is not None and self._split_on(e):
                logger.info(
                    "batch of %d failed (%s); retrying its items one by one",
                    len(batch),
                    e,
                )
                await asyncio.gather(*(self._run([pending]) for pending in batch))
                return
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def close(self) -> None:
        """Stop batching; waiters not yet answered, and later submissions, get CancelledError."""
        self._closed = True
        tasks = [t for t in (self._collector, *self._running) if t is not None]
        await cancel_and_wait(tasks)
        for _, future in self._items:
            future.cancel()
        self._items.clear()
