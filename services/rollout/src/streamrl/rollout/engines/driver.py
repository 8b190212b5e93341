"""The driver thread both engines run their model in: commands in through a queue, results out as futures.

The asyncio side never blocks: ``generate`` and ``update_weights`` queue a command and await its
``concurrent.futures.Future``; the thread (each engine's ``_drive``) takes commands between its own
steps. What is the same in both engines is here; each writes its own ``_submit`` (what it refuses).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

from streamrl.rollout.engines.engine import WeightUpdate

logger = logging.getLogger(__name__)


class DriverThread:
    """The part of an engine that talks to its driver thread. The engine sets ``_commands``, ``_lock``,
    ``_closed``, ``_thread`` and ``_version`` (the version it serves) in its constructor and writes
    ``_submit``; ``close`` calls :meth:`_stop_driver` once."""

    _commands: queue.SimpleQueue[Any]
    _lock: threading.Lock
    _closed: bool
    _thread: threading.Thread
    _version: int

    @property
    def version(self) -> int:
        """Policy version of the weights served now (0 = the weights the engine was built from)."""
        return self._version

    def _submit(self, command: Any) -> None:
        raise NotImplementedError

    async def _run_update(self, update: WeightUpdate) -> None:
        """Queue ``update`` to the driver thread and wait until the engine serves its version."""
        self._submit(update)
        try:
            seconds = await asyncio.wrap_future(update.future)
        except asyncio.CancelledError:  # given up: the driver thread stops fetching it, or never starts
            update.abandoned.set()
            raise
        logger.info("serving weights version %d (update took %.3f s)", update.event.version, seconds)

    def _stop_driver(self, stop: object) -> bool:
        """Queue ``stop`` (the engine's stop command) and wait for the thread; False when already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._commands.put(stop)
        self._thread.join()
        return True
