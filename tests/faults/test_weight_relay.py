"""Weights over the relay transport (``learner.weights_transport = "relay"``) with three rollout workers, and
the two relay faults of issue 39 item 6.

The workers form a chain by instance name: learner -> rollout-0 -> rollout-1 -> rollout-2 (each advertises its
relay node in its heartbeat; each picks its upstreams from the live ones).

* A relay killed mid-transfer: rollout-1 is frozen (SIGSTOP) once the batch of version ``V`` is built, so when
  ``V`` is published rollout-2 connects to it and waits on it; then rollout-1 is SIGKILLed with rollout-2's
  fetch open on it, and a replacement worker (``rollout-3``) starts as an orchestrator would. rollout-2 must
  re-source (rollout-0, then the learner) and serve ``V`` within the sync deadline.
* A learner restart mid-distribution: rollout-1 and rollout-2 are frozen while rollout-0 alone fetches ``V``;
  the learner is SIGKILLed, then they resume: they must serve ``V`` from their peer while the learner is
  still down, before it restarts.

In both the run completes with nothing lost, and every trajectory was generated with a version the learner
published and signed (a worker reports a version only once every chunk verified against the signed checksum).
"""

from __future__ import annotations

import re
import time

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

from streamrl.common.codec import decode
from streamrl.common.messages import TrajectoryRecord, WeightsPublished

pytestmark = pytest.mark.slow
TOTAL_STEPS = 10
V = 5
"""The version distributed during the fault."""
SYNC_DEADLINE_S = 20.0
STALL_S = 3.0
DOWN_S = 8.0
"""How long the learner stays dead in the restart row (s): long enough for the workers to finish from a peer."""
RECOVERY_BOUND_S = {"relay": 30.0, "learner": 45.0}
"""From the fault's end to the next trained batch (s); a restarted learner loads the model and replays a step."""
OVERRIDES = [
    f"--total_steps={TOTAL_STEPS}",
    "--learner.weights_transport=relay",
    f"--rollout.weight_sync_timeout_s={SYNC_DEADLINE_S}",
    f"--rollout.weights_relay.stall_s={STALL_S}",
]
RELAY_LINE = re.compile(rb"fetching version (\d+) over the relay from (.*)")
SYNC_LINE = re.compile(rb"now serving policy version (\d+) \(sync took (\d+) ms over relay\)")


def three_workers(run: FaultRun) -> None:
    run.start_service("rollout", "rollout-1")
    run.start_service("rollout", "rollout-2")
    run.wait_until("three rollout workers serving", lambda: len(run.served()) == 3, 120)
    run.wait_served(V - 1)
    run.wait_until(f"batch {V - 1}", lambda: run.client.xlen(run.names.batches) >= V, 60)


def relayed(run: FaultRun, instance: str) -> dict[int, str]:
    """Per version, the peers ``instance`` planned to fetch from (its log: the last plan of each version)."""
    text = run.procs[instance].log.read_bytes()
    return {int(m[1]): m[2].decode() for m in RELAY_LINE.finditer(text)}


def sync_ms(run: FaultRun, instance: str) -> dict[int, int]:
    """Per version, how long ``instance``'s relay sync took (ms; its log)."""
    return {int(m[1]): int(m[2]) for m in SYNC_LINE.finditer(run.procs[instance].log.read_bytes())}


def verified_only(run: FaultRun) -> list[str]:
    """Every trajectory's versions are 0 (the model's own) or versions the learner published (signed: the
    accounting checks every event's signature)."""
    published = {0} | {decode(p, WeightsPublished).version for _, p in run.entries(run.names.weights)}
    bad = []
    for entry_id, payload in run.entries(run.names.trajectories):
        record = decode(payload, TrajectoryRecord)
        if {record.policy_version_start, record.policy_version_end} - published:
            bad.append(entry_id)
    return [f"trajectories generated with an unpublished version: {bad[:5]}"] if bad else []


def test_a_relay_killed_mid_transfer(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("relay-killed", OVERRIDES).start()
    three_workers(run)
    run.pause("rollout-1")
    run.wait_version(V, timeout_s=60)
    run.wait_until(f"rollout-2 fetching version {V}", lambda: V in relayed(run, "rollout-2"), SYNC_DEADLINE_S)
    time.sleep(1.0)  # its fetch is open on the frozen rollout-1 (connected, nothing received: stall_s is 3 s)
    run.kill("rollout-1")
    killed = time.time()
    run.start_service("rollout", "rollout-3")  # the orchestrator's replacement
    run.wait_until(f"rollout-2 serving version {V}", lambda: run.served().get("rollout-2", -1) >= V, SYNC_DEADLINE_S)
    served_s = round(time.time() - killed, 1)
    plans = relayed(run, "rollout-2")
    run.details.update(
        rollout2_served_after_kill_s=served_s,
        rollout2_upstreams=plans.get(V, ""),
        # the first version >= V it served: the learner may have published V + 1 while it waited on the relay
        rollout2_sync_ms=next(([v, ms] for v, ms in sorted(sync_ms(run, "rollout-2").items()) if v >= V), None),
    )

    def checks() -> list[str]:
        failed = verified_only(run)
        if not plans.get(V, "").startswith("["):
            failed.append(f"rollout-2 fetched version {V} from the learner alone, not over the relay: {plans}")
        if served_s > SYNC_DEADLINE_S:
            failed.append(f"rollout-2 served version {V} {served_s} s after the kill (deadline {SYNC_DEADLINE_S} s)")
        return failed

    conclude(
        run,
        "SIGKILL a weight relay mid-transfer",
        total_steps=TOTAL_STEPS,
        fault_end=killed,
        recovery_bound_s=RECOVERY_BOUND_S["relay"],
        checks=checks,
    )


def test_a_learner_restart_mid_distribution(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("relay-learner-restart", OVERRIDES).start()
    three_workers(run)
    run.pause("rollout-1")
    run.pause("rollout-2")
    run.wait_version(V, timeout_s=60)
    run.wait_until(f"rollout-0 serving version {V}", lambda: run.served().get("rollout-0", -1) >= V, 30)
    run.kill("learner-0")
    killed = time.time()
    run.resume("rollout-1")
    run.resume("rollout-2")
    run.wait_until(
        f"rollout-1 and rollout-2 serving version {V} from a peer, the learner down",
        lambda: min(run.served().get(w, -1) for w in ("rollout-1", "rollout-2")) >= V,
        DOWN_S,
    )
    from_peers_s = round(time.time() - killed, 1)
    time.sleep(max(0.0, DOWN_S - from_peers_s))
    run.start_service("learner", "learner-0")
    restarted = time.time()
    run.details.update(
        served_from_peers_after_kill_s=from_peers_s,
        upstreams={w: relayed(run, w).get(V, "") for w in ("rollout-1", "rollout-2")},
    )
    conclude(
        run,
        "SIGKILL learner mid-distribution (relay)",
        total_steps=TOTAL_STEPS,
        fault_end=restarted,
        recovery_bound_s=RECOVERY_BOUND_S["learner"],
        checks=lambda: verified_only(run),
    )
