"""Pausing the reward worker's intake on a permanent error, and resuming it when a probe is scored.

A permanent error (:class:`streamrl.reward.scorers.PermanentScorerError`: the backend refused the token, or
stayed unreachable past every retry) fails every trajectory the same way. Retried as a transient one, each
entry was dead-lettered and its group replaced: in 240 s a wrong token burnt 76% of a dataset while the policy
version never moved. Instead the worker pauses:

* the delivery that met the error does not fail: it waits, and so does every other delivery that reaches a
  scorer meanwhile. They hold their in-flight slots, so the consumer loop reads nothing more: intake stops,
  and the entries stay pending (kept alive by their consumer, never charged a delivery, never dead-lettered);
* the cause is said once, loudly (one ERROR line), and shown: ``on_change(cause)`` - the worker's heartbeat
  then says ``paused`` with the reason, which the coordinator puts on the progress line and heeds by issuing
  no prompts while it lasts;
* every ``probe_interval_s`` a probe scores the sample that met the error again. When it is scored, or fails
  for any other reason (the backend answers again), the pause ends by itself: one INFO line with how long it
  lasted, ``on_change("")``, and the waiting deliveries go back to their scorers.

Every wait here has a deadline: a waiting delivery looks again every ``probe_interval_s``, and each probe is one
scorer call, bounded by that scorer's own time-outs and retries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from streamrl.common.aio import cancel_and_wait, wait_set
from streamrl.reward.scorers.base import PermanentScorerError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class IntakePause(Generic[T]):
    """The pause of one reward worker; see the module docstring.

    Example:
        pause = IntakePause(probe=score_one, probe_interval_s=5.0, on_change=set_heartbeat_reason)
        while True:
            await pause.wait()
            try:
                return await score(sample)
            except PermanentScorerError as e:
                pause.trip(str(e), sample)
    """

    def __init__(
        self, probe: Callable[[T], Awaitable[object]], probe_interval_s: float, on_change: Callable[[str], None]
    ) -> None:
        if probe_interval_s <= 0:
            raise ValueError(f"probe_interval_s must be > 0, got {probe_interval_s}")
        self._probe = probe
        self.probe_interval_s = probe_interval_s
        self._on_change = on_change
        self.cause: str | None = None
        """Why intake is paused; None while it runs."""
        self.since = 0.0
        """When the pause began (``time.monotonic()``)."""
        self.num_pauses = 0
        """Pauses so far."""
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._prober: asyncio.Task[None] | None = None
        self._closed = False

    async def wait(self) -> None:
        """Return at once while intake runs; while it is paused, once it resumes. CancelledError once closed (the
        worker is stopping: the delivery's entry stays pending for the next consumer)."""
        if self._resumed.is_set():
            return
        while not self._resumed.is_set():
            await wait_set(self._resumed, self.probe_interval_s)
        if self._closed:
            raise asyncio.CancelledError("the reward worker is stopping while paused")

    def trip(self, cause: str, sample: T) -> None:
        """A permanent error met ``sample``: pause (said once, however many deliveries meet it) and probe with it.
        CancelledError once closed (the worker is stopping: the entry stays pending)."""
        if self._closed:
            raise asyncio.CancelledError(f"the reward worker is stopping: {cause}")
        if self.cause is not None:
            return
        self.cause, self.since = cause, time.monotonic()
        self.num_pauses += 1
        self._resumed.clear()
        logger.error(
            "reward scoring PAUSED: %s. Intake stopped: nothing more is consumed, what is held stays pending (none "
            "dead-lettered); probing every %.0f s, scoring resumes by itself once the backend accepts",
            cause,
            self.probe_interval_s,
        )
        self._on_change(cause)
        self._prober = asyncio.create_task(self._probe_until_accepted(sample), name="reward-probe")

    async def _probe_until_accepted(self, sample: T) -> None:
        probes = 0
        while True:
            await asyncio.sleep(self.probe_interval_s)
            probes += 1
            try:
                await self._probe(sample)
            except PermanentScorerError as e:
                logger.debug("probe %d: still refused: %s", probes, e)
                continue
            except Exception as e:  # noqa: BLE001 - any other outcome means the backend answers again
                logger.info("probe %d failed otherwise (%s): the backend answers again", probes, e)
            break
        logger.info(
            "reward scoring RESUMED after %.1f s paused (%d probes): %s",
            time.monotonic() - self.since,
            probes,
            self.cause,
        )
        self.cause = None
        self._on_change("")
        self._resumed.set()

    async def close(self) -> None:
        """Stop probing; the deliveries waiting for the pause to end get CancelledError now (nothing to drain)."""
        self._closed = True
        if self._prober is not None:
            await cancel_and_wait([self._prober])
        self._resumed.set()
