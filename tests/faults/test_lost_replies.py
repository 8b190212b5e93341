"""Lost replies: a write that Redis ran, whose reply never reached the service (tests/faults/redis_proxy.py).

Every service reaches Redis through the fault proxy. The client sees its connection drop after
Redis ran the command, and its outage retry sends the command again: any write that is not
idempotent runs twice (a duplicated batch, a counter moved twice, a lease the holder cannot renew).

* ``test_write_points``: a run with the proxy passing everything through; the row lists every kind
  of write each service makes (the write points the other rows cover).
* ``test_lost_reply[service]``: the proxy loses the reply of each kind of write that service makes,
  once each, in the order the kinds come up, one loss every ``GAP_S`` seconds, from the start of the
  run until two steps before its end (start-up writes included). The row lists the kinds whose reply was lost
  (``lost_replies``) and those seen but never lost (``writes_not_lost``, one-off writes made while
  the previous loss was still recent).

* ``test_lost_reply_of_one_kind[service:kind]`` (off CI, ``FAULTS_EACH_KIND=1``; ``bench/faults.py
  --each-kind``): one run per write point of tests/faults/write_points.json, its reply lost twice.

Each run must end as a clean one: everything issued trained or dropped with a reason, nothing lost,
nothing trained twice, nothing pending, every step reached, no service exit.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from harness import SERVICES, FaultRun, MakeRun
from redis_proxy import LoseEachKind
from scenario import conclude

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
GAP_S = 0.5
"""Between two lost replies of one service (s): its retry backs off, reconnects and goes on first."""
ONLY_ENV = "FAULTS_LOSE_ONLY"
"""Comma-separated kind prefixes (``XREADGROUP,EVALSHA bus``): lose only those (to look at one write point)."""
CLAIM_IDLE_MS = 10_000
"""``consumer.claim_idle_ms`` here: entries delivered by a read whose reply was lost sit in the pending
list of a consumer that never saw them until reclaimed (30 s by default)."""
OVERRIDES = [f"--total_steps={TOTAL_STEPS}", f"--consumer.claim_idle_ms={CLAIM_IDLE_MS}"]
RECOVERY_BOUND_S = 45.0
"""From the last lost reply to the next trained batch (s)."""
LAST_STEPS_CLEAN = 2
"""No reply is lost once the run reaches ``TOTAL_STEPS - LAST_STEPS_CLEAN``: the recovery from the
last loss is measured to a batch trained after it."""


def test_write_points(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("proxy-write-points", OVERRIDES)
    proxy = run.use_proxy()
    run.start()

    def checks() -> list[str]:
        seen = proxy.writes_by_service()
        return [f"no write of {s} went through the proxy" for s in SERVICES if not seen.get(s)]

    conclude(
        run,
        "proxy, no fault (write points)",
        total_steps=TOTAL_STEPS,
        fault_end=None,
        recovery_bound_s=None,
        checks=checks,
    )


@pytest.mark.parametrize("service", SERVICES)
def test_lost_reply(service: str, fault_run: MakeRun) -> None:
    run: FaultRun = fault_run(f"lost-reply-{service}", OVERRIDES)
    proxy = run.use_proxy()
    only = tuple(k.strip() for k in os.environ.get(ONLY_ENV, "").split(",") if k.strip())
    policy = LoseEachKind(service, gap_s=GAP_S, only=only)
    proxy.set_policy(policy)
    run.start()

    def checks() -> list[str]:
        lost = proxy.lost_by_kind(service)
        seen = proxy.writes_by_service().get(service, [])
        run.details["writes_not_lost"] = sorted(set(seen) - set(lost))
        return [] if lost else [f"no reply of {service} was lost"]

    run.wait_version(TOTAL_STEPS - LAST_STEPS_CLEAN, timeout_s=240)
    proxy.set_policy(None)
    last_loss = max((r.at for r in proxy.lost), default=None)
    conclude(
        run,
        f"lost reply: {service} writes",
        total_steps=TOTAL_STEPS,
        fault_end=last_loss,
        recovery_bound_s=RECOVERY_BOUND_S if last_loss else None,
        checks=checks,
    )


EACH_KIND_ENV = "FAULTS_EACH_KIND"
"""Set to 1 to run one row per (service, kind of write) (off CI: ~80 runs): ``bench/faults.py --each-kind``."""
SHUTDOWN_KINDS = ("DEL hb:", "SREM instances", "EVAL lease.RELEASE_LUA", "HDEL served")
"""Writes a service makes only as it stops: their replies are lost up to the end of the run."""
WRITE_POINTS = Path(__file__).with_name("write_points.json")
"""Every kind of write each service made in a run through the proxy (``test_write_points``'s list, kept
here so the rows can be named before a run)."""


def _kinds() -> list[tuple[str, str]]:
    points = json.loads(WRITE_POINTS.read_text()) if WRITE_POINTS.exists() else {}
    return [(service, kind) for service, kinds in sorted(points.items()) for kind in kinds]


@pytest.mark.skipif(os.environ.get(EACH_KIND_ENV) != "1", reason=f"one row per write point: {EACH_KIND_ENV}=1")
@pytest.mark.parametrize(("service", "kind"), _kinds(), ids=[f"{s}:{k}" for s, k in _kinds()])
def test_lost_reply_of_one_kind(service: str, kind: str, fault_run: MakeRun) -> None:
    run: FaultRun = fault_run(f"lost-{service}-{re.sub(r'[^A-Za-z0-9]+', '-', kind)[:40]}", OVERRIDES)
    proxy = run.use_proxy()
    proxy.set_policy(LoseEachKind(service, gap_s=GAP_S, times=2, only=(kind,)))
    run.start()
    at_shutdown = kind.startswith(SHUTDOWN_KINDS)
    if not at_shutdown:
        run.wait_version(TOTAL_STEPS - LAST_STEPS_CLEAN, timeout_s=240)
        proxy.set_policy(None)
    last_loss = max((r.at for r in proxy.lost), default=None)

    def checks() -> list[str]:
        return [] if proxy.lost else [f"no reply of {service}'s {kind} was lost (not made before the end)"]

    conclude(
        run,
        f"lost reply: {service} {kind}",
        total_steps=TOTAL_STEPS,
        fault_end=last_loss,
        recovery_bound_s=RECOVERY_BOUND_S if last_loss and not at_shutdown else None,
        checks=checks,
    )
