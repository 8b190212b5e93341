"""The sync reward function's own threads: a bounded number, time-outs counted from the start of a call,
and a clear signal once every thread is held by a call that never returns."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from streamrl.common.aio import timeout
from streamrl.reward.threads import CallTimeoutError, ThreadCaller, ThreadsExhaustedError


def test_a_call_queued_behind_busy_threads_is_not_timed_out_for_their_time() -> None:
    async def main() -> list[None]:
        caller = ThreadCaller(1, "t")
        # the last call waits 0.8 s behind the others, past its 0.6 s deadline; its own run takes 0.2 s (0.4 s of
        # slack for a loaded machine's thread start)
        return await asyncio.gather(*(caller.call(0.6, time.sleep, 0.2) for _ in range(5)))  # 1.0 s in all

    started = time.monotonic()
    assert asyncio.run(main()) == [None] * 5
    assert time.monotonic() - started >= 1.0


def test_threads_held_by_calls_that_never_return_exhaust_the_caller_once() -> None:
    forever = threading.Event()
    told: list[str] = []

    async def main() -> None:
        caller = ThreadCaller(2, "t", on_exhausted=told.append)
        with pytest.raises(CallTimeoutError, match=r"timed out after 0\.1 s") as first:
            await caller.call(0.1, forever.wait)
        assert caller.num_overdue == 1 and caller.exhausted is None and not told
        assert await caller.call(0.5, lambda: 7) == 7  # the other thread still serves
        # a call whose caller gave up (cancelled) is judged at its deadline all the same
        cancelled = asyncio.ensure_future(caller.call(0.2, forever.wait))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await asyncio.sleep(0.3)
        assert told == ["every one of its 2 threads is held by a call that timed out and has not returned"]
        with pytest.raises(ThreadsExhaustedError, match="every one of its 2 threads"):
            await caller.call(0.5, lambda: 7)
        forever.set()  # the function returns at last: its thread is free again
        await asyncio.wait_for(first.value.returned, 2)
        assert caller.num_overdue == 0

    asyncio.run(main())
    assert len(told) == 1


def test_what_the_function_raises_reaches_the_caller() -> None:
    def bad() -> None:
        raise KeyError("label")

    with pytest.raises(KeyError, match="label"):
        asyncio.run(ThreadCaller(1, "t").call(1.0, bad))


class _StoppedClock:
    """A ``time`` module whose monotonic clock stands still: a judgement that compares deadlines with it
    always finds the timed-out calls not yet due, as the event loop's timer firing early made it do at
    random (the loop fires a timer up to its clock resolution before ``time.monotonic()`` reaches it)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


def test_exhaustion_is_judged_from_the_calls_not_from_a_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamrl.reward import threads

    monkeypatch.setattr(threads, "time", _StoppedClock(), raising=False)
    forever = threading.Event()
    told: list[str] = []

    async def main() -> None:
        caller = ThreadCaller(2, "t", on_exhausted=told.append)
        hung = [asyncio.ensure_future(caller.call(0.1, forever.wait)) for _ in range(2)]
        # a third call waits for a thread; it must hear of the exhaustion, not wait on
        waiting = asyncio.ensure_future(caller.call(0.1, lambda: 7))
        async with timeout(5.0):  # the deadline of this test; the fault being tested waits for ever
            for call in hung:
                with pytest.raises(CallTimeoutError):
                    await call
            with pytest.raises(ThreadsExhaustedError, match="every one of its 2 threads"):
                await waiting
        assert caller.num_overdue == 2 and caller.exhausted is not None
        forever.set()

    asyncio.run(main())
    assert len(told) == 1
