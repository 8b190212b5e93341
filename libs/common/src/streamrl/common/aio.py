"""The services' event loop, stopping asyncio tasks for sure, and timeouts, on every Python the services run on
(3.10-3.12).

:func:`run` runs a service's main coroutine on uvloop (libuv's event loop: the same asyncio API, about half the
CPU per Redis round trip of the standard loop), or on the standard loop when ``STREAMRL_EVENT_LOOP=asyncio``
(to rule the loop out when debugging).

Python 3.10 and 3.11's ``asyncio.wait_for`` drops a cancellation that arrives in the same loop
iteration as the awaited call completes (fixed in 3.12). redis-py awaits it inside commands, so a
task cancelled in the middle of a command can go on running as if nothing happened: a heartbeat
loop then never ends and the service never exits. :func:`cancel_and_wait` cancels again until the
tasks have really ended, and streamrl's own code waits with :func:`wait_set` / :func:`timeout`,
never ``wait_for``.

:func:`timeout` is ``asyncio.timeout`` (3.11+); on 3.10 it is the ``async-timeout`` package that
``asyncio.timeout`` came from, raising the builtin ``TimeoutError`` as 3.11 does (3.10's
``asyncio.TimeoutError`` is another class, which ``except TimeoutError`` would not catch).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:
    import async_timeout

    @contextlib.asynccontextmanager
    async def timeout(delay: float | None) -> AsyncIterator[None]:
        """``async with timeout(delay_s):`` cancels the block after ``delay`` s and raises ``TimeoutError``."""
        try:
            async with async_timeout.timeout(delay):
                yield
        except asyncio.TimeoutError as e:
            raise TimeoutError from e


__all__ = ["EVENT_LOOP_ENV", "RECANCEL_S", "cancel_and_wait", "event_loop", "run", "timeout", "wait_set"]

T = TypeVar("T")
EVENT_LOOP_ENV = "STREAMRL_EVENT_LOOP"
"""Environment variable naming the event loop :func:`run` uses: ``uvloop`` (the default) or ``asyncio``."""
EVENT_LOOPS = ("uvloop", "asyncio")


def event_loop() -> str:
    """The event loop :envvar:`STREAMRL_EVENT_LOOP` asks for; ValueError naming the choices for another."""
    choice = os.environ.get(EVENT_LOOP_ENV, "uvloop").strip() or "uvloop"
    if choice not in EVENT_LOOPS:
        raise ValueError(
            f"{EVENT_LOOP_ENV}={choice!r} is not an event loop streamrl runs on: {' or '.join(EVENT_LOOPS)}"
        )
    return choice


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on the event loop :func:`event_loop` names (call it first to check the choice)."""
    if event_loop() == "asyncio":
        return asyncio.run(main)
    import uvloop

    return uvloop.run(main)


RECANCEL_S = 0.5
"""How long a cancelled task gets to end before it is cancelled again (s)."""


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], *, recancel_s: float = RECANCEL_S) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling again those that carry on."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True if it was set."""
    try:
        async with timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
