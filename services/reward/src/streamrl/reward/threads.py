"""Threads of its own for a user's synchronous function: bounded, timed, never shared.

A synchronous reward function runs in a thread so that it never blocks the event loop, and a thread
cannot be stopped: a call that overruns its time-out keeps its thread until the function returns,
which for a function stuck on some input is never. In the shared default executor such threads
piled up until nothing else could run there - scoring stopped while the heartbeat stayed healthy.
:class:`ThreadCaller` keeps that bounded and visible:

* at most ``max_threads`` calls run at once; a call waits for a free thread *before* its time-out
  starts (time queued behind other calls is not the function's);
* a call past its time-out raises :class:`CallTimeoutError` at once and leaves its thread running; the
  thread is free again when the function returns (``CallTimeoutError.returned`` says when);
* the threads are daemon threads: a function that never returns does not keep the process from
  exiting;
* when every thread is held by a call past its time-out nothing can run any more: the caller is told
  once (``on_exhausted`` with the reason) and :attr:`ThreadCaller.exhausted` is set - the reward
  worker then exits non-zero for its orchestrator to restart it. Calls waiting for a thread are woken
  and raise :class:`ThreadsExhaustedError`, so no wait here outlives the time-outs of the calls running.

Exhaustion is judged from state, never from a clock: each call past its time-out marks itself overdue
when its own timer fires (a call whose caller gave up, at its deadline all the same), and the mark that
makes every running call overdue is the one that exhausts the caller. (Comparing deadlines with
``time.monotonic()`` instead lost a race about one time in 30: the event loop fires a timer up to its
clock resolution early, so the last time-out could count ``max_threads - 1`` overdue calls, and the
worker then waited for a thread for ever while its heartbeat stayed healthy.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

from streamrl.common.aio import timeout


class CallTimeoutError(TimeoutError):
    """A call overran its time-out; its thread runs on until the function returns."""

    def __init__(self, message: str, returned: asyncio.Future[None]) -> None:
        super().__init__(message)
        self.returned = returned
        """Done when the function has returned (or raised) at last and its thread is free."""


class ThreadsExhaustedError(RuntimeError):
    """Every thread is held by a call past its time-out: no call can run any more."""


class ThreadCaller:
    """Runs calls of synchronous functions on at most ``max_threads`` daemon threads; see the module docstring.

    Example:
        caller = ThreadCaller(8, "reward-math", on_exhausted=lambda why: stop.set())
        output = await caller.call(300.0, reward_func, queries, prompts, labels)
    """

    def __init__(self, max_threads: int, name: str, on_exhausted: Callable[[str], None] | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.name = name
        self._on_exhausted = on_exhausted
        self._waiters: list[asyncio.Future[None]] = []
        """Calls waiting for a thread, woken when one is free again or the caller is exhausted."""
        self._running: set[int] = set()
        """Calls whose function has not returned yet (each holds a thread)."""
        self._overdue: set[int] = set()
        """Those of ``_running`` past their time-out: marked by their own timer, never by reading a clock."""
        self._ids = itertools.count()
        self.exhausted: str | None = None
        """Why no call can run any more (every thread held by a call past its time-out); None until then."""

    @property
    def num_overdue(self) -> int:
        """Threads held by a call past its time-out now."""
        return len(self._overdue)

    async def call(self, timeout_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on a thread of this caller, waited for at most ``timeout_s`` once started.

        Raises what ``fn`` raises, :class:`CallTimeoutError` past ``timeout_s``, or :class:`ThreadsExhaustedError`
        (also to a call that was waiting for a thread when the last one was taken by a call past its time-out).
        """
        loop = asyncio.get_running_loop()
        while self.exhausted is None and len(self._running) >= self.max_threads:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
        if self.exhausted is not None:
            raise ThreadsExhaustedError(self.exhausted)
        call = next(self._ids)
        self._running.add(call)
        result: asyncio.Future[Any] = loop.create_future()
        returned: asyncio.Future[None] = loop.create_future()
        deadline = loop.time() + timeout_s

        def finished(value: Any, error: BaseException | None) -> None:  # on the event loop
            self._running.discard(call)
            self._overdue.discard(call)
            self._wake()
            returned.set_result(None)
            if result.done():
                return
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(value)

        def target() -> None:  # on the thread
            value, error = None, None
            try:
                value = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who re-raises it
                error = e
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits any more
                loop.call_soon_threadsafe(finished, value, error)

        threading.Thread(target=target, name=f"{self.name}-{call}", daemon=True).start()
        try:
            async with timeout(timeout_s):
                return await asyncio.shield(result)
        except TimeoutError:
            self._overran(call)
            raise CallTimeoutError(f"timed out after {timeout_s:g} s", returned) from None
        except asyncio.CancelledError:  # the caller gave up: the thread runs on, judged at its deadline all the same
            if not returned.done():
                loop.call_at(deadline, self._overran, call)
            raise

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _overran(self, call: int) -> None:
        """``call`` is past its time-out: mark it; when that leaves no thread for another call, the caller is
        exhausted (told once) and every call waiting for a thread is woken to hear it."""
        if call not in self._running:  # it returned in the meantime
            return
        self._overdue.add(call)
        if self.exhausted is not None or len(self._overdue) < self.max_threads:
            return
        self.exhausted = (
            f"every one of its {self.max_threads} threads is held by a call that timed out and has not returned"
        )
        if self._on_exhausted is not None:
            self._on_exhausted(self.exhausted)
        self._wake()
