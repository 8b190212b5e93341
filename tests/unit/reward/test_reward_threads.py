"""The sync reward function's own threads: a bounded number, time-outs counted from the start of a call,
and a clear signal once every thread is held by a call that never returns."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

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
