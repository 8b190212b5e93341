"""Stopping asyncio tasks for sure, and timeouts, on every Python the services run on (3.10-3.12).

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
import sys
from collections.abc import AsyncIterator, Iterable
from typing import Any

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


__all__ = ["RECANCEL_S", "cancel_and_wait", "timeout", "wait_set"]


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
