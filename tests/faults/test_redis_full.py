"""Redis at its ``maxmemory``: every write refused with OOM for ~10 s, then room again.

Mid-run the scenario sets ``maxmemory-policy noeviction`` and a ``maxmemory`` a few MiB above what
Redis holds, then fills that room with a junk key (not a key of the run), so every write of every
service is refused with ``OOM command not allowed when used memory > 'maxmemory'``. After
``FULL_S`` seconds it deletes the junk and lifts the limit. A refused write did not run, so the
services must treat it as an outage (retry until it goes through) and ride it out: no service exits,
nothing lost, nothing trained twice. The row records how many OOM errors Redis answered
(``errorstat_OOM``), which shows the services really hit the wall.
"""

from __future__ import annotations

import time

import pytest
import redis as syncredis
from harness import FaultRun, MakeRun
from scenario import conclude

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
FULL_AT_VERSION = 4
FULL_S = 10.0
HEADROOM = 4 * 2**20
"""``maxmemory`` = used memory + this (bytes), then filled by the junk key."""
JUNK_KEY = "faults:junk"
CHUNK = b"x" * 2**18
RECOVERY_BOUND_S = 30.0
"""From the junk freed to the next trained batch (s): the clients back off up to 2 s between tries."""


def _fill(client: syncredis.Redis) -> int:
    """Append to the junk key until Redis refuses with OOM; returns the bytes written."""
    written = 0
    while True:
        try:
            client.append(JUNK_KEY, CHUNK)
        except syncredis.exceptions.OutOfMemoryError:  # redis-py's class for the "OOM ..." error reply
            return written
        written += len(CHUNK)


def _oom_errors(client: syncredis.Redis) -> int:
    stats = client.info("errorstats")
    return int(stats.get("errorstat_OOM", {}).get("count", 0))


def test_redis_at_maxmemory(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("redis-full", [f"--total_steps={TOTAL_STEPS}"]).start()
    run.wait_version(FULL_AT_VERSION)
    client = run.client
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + HEADROOM)
    junk = _fill(client)
    time.sleep(FULL_S)
    refused = _oom_errors(client) - 1  # less the fill's own last append
    client.delete(JUNK_KEY)
    client.config_set("maxmemory", 0)
    freed = time.time()
    run.details.update(junk_bytes=junk, oom_refusals=refused, full_s=FULL_S)

    def checks() -> list[str]:
        return [] if refused > 0 else ["no service write was refused while redis was full: the scenario did nothing"]

    conclude(
        run,
        f"redis at maxmemory (noeviction) for {FULL_S:g} s",
        total_steps=TOTAL_STEPS,
        fault_end=freed,
        recovery_bound_s=RECOVERY_BOUND_S,
        checks=checks,
    )
