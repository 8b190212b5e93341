"""Stopping asyncio tasks for sure, on the Python 3.11 the services run on.

Python 3.11's ``asyncio.wait_for`` drops a cancellation that arrives in the same loop iteration as
the awaited call completes (fixed in 3.12). redis-py awaits it inside commands, so a task cancelled
in the middle of a command can go on running as if nothing happened: a heartbeat loop then never
ends and the service never exits. :func:`cancel_and_wait` cancels again until the tasks have really
ended, and streamrl's own code waits with :func:`wait_set` / ``asyncio.timeout``, never ``wait_for``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_S = 0.5
"""How long a cancelled task gets to end before it is cancelled again (s)."""


async def cancel_and_wait(tasks: Iterable[asyncio.Future[object]], *, recancel_s: float = RECANCEL_S) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling again those that carry on."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True if it was set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
