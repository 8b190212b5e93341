"""Keeping a service's leases through pauses of its event loop, and measuring those pauses.

* :class:`StartupRenewer`: while a service starts (``ctx.status == "starting"``: building its
  dataset, tokenizer, model, wandb run - blocking work that holds the event loop for seconds to
  minutes), a thread renews its leases with its own Redis connection, so a slow start never costs
  the lease (a standby would otherwise take over the coordinator while it is still starting, and it
  would stop with LeaseLostError). Once the service runs, renewals are the heartbeat's again (on the
  event loop): a loop stalled past the lease TTL then loses the lease, as it should.
* :func:`watch_loop_lag`: a task that sleeps 0.1 s and records how late it wakes up: the event
  loop's pauses. The worst one since the service runs is in its heartbeat (``loop_lag_s``); a pause
  over half the lease TTL is logged as a WARNING (the TTL, ``consumer.lease_ttl_s``, must cover it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import redis as syncredis

from streamrl.common.lease import RENEW_LUA, Lease, lost_to

logger = logging.getLogger(__name__)
LAG_PERIOD_S = 0.1


class StartupRenewer:
    """Renews ``leases`` (the list may grow) every ``interval_s`` from a thread while ``starting()``."""

    def __init__(self, url: str, leases: list[Lease], interval_s: float, starting: Callable[[], bool]) -> None:
        self.url = url
        self.leases = leases
        self.interval_s = interval_s
        self.starting = starting
        self.lost: str | None = None
        """Why a lease turned out lost to another process (the heartbeat's renewal then stops the service)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)

    def start(self) -> StartupRenewer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (a no-op if never started: the service stopped before it held a lease)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        client = syncredis.Redis.from_url(self.url, socket_timeout=max(1.0, self.interval_s))
        try:
            while not self._stop.wait(self.interval_s) and self.starting() and self.lost is None:
                for lease in list(self.leases):
                    try:
                        self._renew(client, lease)
                    except syncredis.RedisError as e:  # Redis away: the next round tries again
                        logger.debug("start-up lease renewal failed: %s", e)
        finally:
            client.close()

    def _renew(self, client: syncredis.Redis, lease: Lease) -> None:
        reply = client.eval(RENEW_LUA, 2, *lease.renew_args())
        if reply not in (1, 2):
            self.lost = lost_to(reply)


async def watch_loop_lag(
    record: Callable[[float], None], ttl_s: float, running: Callable[[], bool], period_s: float = LAG_PERIOD_S
) -> None:
    """Measure the event loop's pauses until cancelled: ``record(pause_s)`` each time the service runs;
    a WARNING for a pause over half ``ttl_s`` (an INFO line while it starts: leases are renewed by
    :class:`StartupRenewer` then)."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(period_s)
        pause = time.monotonic() - before - period_s
        if pause > ttl_s / 2:
            if running():
                logger.warning(
                    "the event loop paused %.1f s, over half the lease TTL (%.1f s): blocking work on the loop, "
                    "or raise consumer.lease_ttl_s",
                    pause,
                    ttl_s,
                )
            else:
                logger.info(
                    "start-up blocked the event loop for %.1f s (leases renewed from a thread meanwhile)", pause
                )
        if running():
            record(pause)
