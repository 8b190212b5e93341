"""Redis at its ``maxmemory``: every write refused with OOM for ~10 s, then room again.

Mid-run the scenario writes a junk key (not a key of the run) of ``JUNK_BYTES``, then sets
``maxmemory-policy noeviction`` and a ``maxmemory`` ``BELOW_BYTES`` under what Redis then holds, so
every write of every service is refused with ``OOM command not allowed when used memory > 'maxmemory'``.
The wall is far below the used memory on purpose: a limit just at the used memory is not a wall, since the
services' own deletes and trims (allowed under OOM) free a little room and the next writes go through
(under load a whole run once finished "while Redis was full"). After
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
JUNK_BYTES = 64 * 2**20
BELOW_BYTES = 32 * 2**20
"""``maxmemory`` = used memory (junk included) - this; more than the run ever holds (docs/operations.md)."""
JUNK_KEY = "faults:junk"
CHUNK = b"x" * 2**20
RECOVERY_BOUND_S = 30.0
"""From the junk freed to the next trained batch (s): the clients back off up to 2 s between tries."""


def _fill(client: syncredis.Redis) -> int:
    """Write the junk key; returns its size (bytes)."""
    for _ in range(JUNK_BYTES // len(CHUNK)):
        client.append(JUNK_KEY, CHUNK)
    return int(client.strlen(JUNK_KEY))


def _oom_errors(client: syncredis.Redis) -> int:
    stats = client.info("errorstats")
    return int(stats.get("errorstat_OOM", {}).get("count", 0))


def test_redis_at_maxmemory(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("redis-full", [f"--total_steps={TOTAL_STEPS}"]).start()
    run.wait_version(FULL_AT_VERSION)
    client = run.client
    junk = _fill(client)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - BELOW_BYTES)
    full_at = run.version()
    time.sleep(FULL_S)
    refused = _oom_errors(client)
    trained_while_full = run.version() - full_at
    client.config_set("maxmemory", 0)
    client.delete(JUNK_KEY)
    freed = time.time()
    run.details.update(junk_bytes=junk, oom_refusals=refused, full_s=FULL_S, versions_while_full=trained_while_full)

    def checks() -> list[str]:
        failed = [] if refused > 0 else ["no service write was refused while redis was full: the scenario did nothing"]
        if trained_while_full > 1:  # one publish may have landed between the version read and the limit
            failed.append(f"{trained_while_full} policy versions published while redis was full: the wall leaked")
        return failed

    conclude(
        run,
        f"redis at maxmemory (noeviction) for {FULL_S:g} s",
        total_steps=TOTAL_STEPS,
        fault_end=freed,
        recovery_bound_s=RECOVERY_BOUND_S,
        checks=checks,
    )
