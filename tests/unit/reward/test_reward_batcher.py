"""The async micro-batcher: grouping, routing, errors, isolation of a bad item, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.reward.batcher import MicroBatcher


class Recorder:
    """A batched function that doubles numbers, records its batches, and fails on request."""

    def __init__(self, fail_on: int | None = None, delay_s: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on
        self.delay_s = delay_s

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await asyncio.sleep(self.delay_s)
        if self.fail_on in items:
            raise ValueError(f"bad item {self.fail_on}")
        return [2 * x for x in items]


def test_concurrent_submits_are_grouped_and_routed_back() -> None:
    async def main() -> tuple[list[int], Recorder]:
        fn = Recorder()
        batcher = MicroBatcher(fn, max_batch_size=4, max_wait_ms=50)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(10)))
        await batcher.close()
        return results, fn

    results, fn = asyncio.run(main())
    assert results == [2 * i for i in range(10)]
    assert fn.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_max_wait_closes_a_partial_batch() -> None:
    async def main() -> tuple[float, Recorder]:
        fn = Recorder()
        batcher = MicroBatcher(fn, max_batch_size=100, max_wait_ms=30)
        loop = asyncio.get_running_loop()
        start = loop.time()
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(batcher.submit(2))  # arrives within the first's wait window
        await asyncio.gather(first, second)
        elapsed = loop.time() - start
        await asyncio.sleep(0.06)
        await batcher.submit(3)  # a later one makes its own batch
        await batcher.close()
        return elapsed, fn

    elapsed, fn = asyncio.run(main())
    assert fn.batches == [[1, 2], [3]]
    assert 0.025 <= elapsed < 0.5


def test_exception_reaches_every_waiter_of_the_batch() -> None:
    async def main() -> list[object]:
        batcher = MicroBatcher(Recorder(fail_on=2), max_batch_size=8, max_wait_ms=20)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(4)), return_exceptions=True)
        await batcher.close()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, ValueError) and str(r) == "bad item 2" for r in results)


def test_split_on_isolates_the_bad_item() -> None:
    async def main() -> tuple[list[object], Recorder]:
        fn = Recorder(fail_on=2)
        batcher = MicroBatcher(
            fn,
            max_batch_size=8,
            max_wait_ms=20,
            split_on=lambda e: isinstance(e, ValueError),
        )
        results = await asyncio.gather(*(batcher.submit(i) for i in range(4)), return_exceptions=True)
        await batcher.close()
        return results, fn

    results, fn = asyncio.run(main())
    assert results[:2] == [0, 2] and results[3] == 6
    assert isinstance(results[2], ValueError)
    assert fn.batches == [[0, 1, 2, 3], [0], [1], [2], [3]]


def test_wrong_result_count_is_an_error() -> None:
    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    async def main() -> None:
        batcher = MicroBatcher(short, max_batch_size=2, max_wait_ms=10)
        await asyncio.gather(batcher.submit(1), batcher.submit(2))

    with pytest.raises(RuntimeError, match="returned 1 results for 2 items"):
        asyncio.run(main())


def test_cancelled_waiter_does_not_break_its_batch() -> None:
    async def main() -> tuple[int, Recorder]:
        fn = Recorder(delay_s=0.05)
        batcher = MicroBatcher(fn, max_batch_size=8, max_wait_ms=10)
        doomed = asyncio.ensure_future(batcher.submit(1))
        kept = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0.02)  # the batch is running
        doomed.cancel()
        result = await kept
        await batcher.close()
        return result, fn

    result, fn = asyncio.run(main())
    assert result == 4 and fn.batches == [[1, 2]]


def test_close_cancels_waiters_and_later_items() -> None:
    """A closed batcher cancels (the consumer leaves the entry pending), never fails an item with an
    error of its own: that error used to reach dead letters as "MicroBatcher is closed"."""

    async def main() -> None:
        batcher = MicroBatcher(Recorder(delay_s=10), max_batch_size=8, max_wait_ms=0)
        waiter = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.01)
        await batcher.close()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        late = asyncio.ensure_future(batcher.submit(2))
        with pytest.raises(asyncio.CancelledError):
            await late
        assert late.cancelled()

    asyncio.run(main())


def test_bad_knobs() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        MicroBatcher(Recorder(), max_batch_size=0, max_wait_ms=1)
