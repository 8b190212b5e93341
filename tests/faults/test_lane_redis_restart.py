"""A run on two lanes (:mod:`streamrl.common.lanes`): two coordinators over the prompt shards, a rollout and a
reward replica per lane, one learner training the joined batches. Lane 1's redis-server is SIGKILLed mid-run and
started again on the same port with its AOF (``appendfsync always``): every service rides out the outage, and the
run reaches ``total_steps`` with every issued group of both lanes trained exactly once and nothing pending.

Two harder faults: lane 1's Redis down for longer than ``redis.outage_s`` (lane 1's own services exit and are
restarted, as an orchestrator does; lane 0's coordinator - the joiner - and the learner never exit, and the run
finishes once the lane is back); and a manifest part of one of lane 1's batches deleted before the join (that
lane batch's groups are counted dropped, the index is joined without them, later indices proceed)."""

from __future__ import annotations

import time

import pytest
from accounting import Lane
from harness import FaultRun, MakeRun
from scenario import conclude

from streamrl.common.codec import decode
from streamrl.common.messages import BATCH_SKIPPED, BatchManifest

pytestmark = pytest.mark.slow
TOTAL_STEPS = 8
KILL_AT_VERSION = 3
DOWN_S = 3.0
RECOVERY_BOUND_S = 45.0
"""From the lane's redis answering again to the next trained batch (s)."""
PAUSE_S = 6.0
"""Longest pause of lane 0's rollout (its lease lives 10 s)."""
LONG_DOWN_S = 75.0
"""Longer than ``redis.outage_s`` (60 s): what the client rides out."""


def test_a_lanes_redis_killed_and_restarted(fault_run: MakeRun) -> None:
    run = kill_and_restart_lane_1(fault_run("lane-redis-restart", [f"--total_steps={TOTAL_STEPS}"], lanes=2), "redis")
    by_lane = {side.names.run_id: {p for _, p in run.entries(side.names.prompts)} for side in run.lane_sides}
    assert all(by_lane.values()), f"a lane issued nothing: {sorted((k, len(v)) for k, v in by_lane.items())}"


def test_a_lanes_cluster_node_killed_and_restarted(fault_run: MakeRun) -> None:
    """The same on a 3-node Redis Cluster on 127.0.0.1: the home, lane 0 and lane 1 by hash slot, lane 1 on a node
    of its own, which is SIGKILLed and restarted (AOF, its nodes.conf) while the other nodes keep serving."""
    run = fault_run("lane-cluster-node-restart", [f"--total_steps={TOTAL_STEPS}"], lanes=2, cluster=True)
    kill_and_restart_lane_1(run, "cluster node")


def kill_and_restart_lane_1(run: FaultRun, what: str) -> FaultRun:
    """Start ``run``, SIGKILL lane 1's Redis at :data:`KILL_AT_VERSION`, start it again :data:`DOWN_S` later, and
    check the finished run (scenario.conclude: nothing lost, nothing twice, nothing pending, every step)."""
    run.start()
    run.wait_version(KILL_AT_VERSION, timeout_s=240)
    run.kill_redis(lane=1)
    time.sleep(DOWN_S)
    run.start_redis(lane=1)
    row = conclude(
        run,
        f"lane 1's {what} SIGKILL, back after {DOWN_S:g} s (AOF)",
        total_steps=TOTAL_STEPS,
        fault_end=time.time(),
        recovery_bound_s=RECOVERY_BOUND_S,
        run_timeout_s=300,
    )
    assert row.counts.issued >= TOTAL_STEPS * 4
    return run


def test_a_lanes_redis_down_longer_than_the_clients_retries(fault_run: MakeRun) -> None:
    run = fault_run("lane-redis-long-outage", [f"--total_steps={TOTAL_STEPS}"], lanes=2)
    run.start()
    run.wait_version(KILL_AT_VERSION, timeout_s=240)
    run.kill_redis(lane=1)
    time.sleep(LONG_DOWN_S)
    joiner_exits = [str(e) for e in run.exits if e.instance in ("coordinator-0", "learner-0")]
    run.details["lane 1 services restarted while down"] = len(run.exits)
    run.start_redis(lane=1)
    row = conclude(
        run,
        f"lane 1's redis down {LONG_DOWN_S:g} s (> redis.outage_s), then back (AOF)",
        total_steps=TOTAL_STEPS,
        fault_end=time.time(),
        recovery_bound_s=RECOVERY_BOUND_S * 2,
        run_timeout_s=400,
        allowed_exits=("coordinator", "rollout", "reward"),  # lane 1's own, whose Redis was gone for > 60 s
        checks=lambda: joiner_exits + [str(e) for e in run.exits if e.instance in ("coordinator-0", "learner-0")],
    )
    assert all(e.instance.endswith("-1") for e in run.exits), [str(e) for e in run.exits]
    assert row.counts.issued >= TOTAL_STEPS * 4


def test_a_lanes_manifest_part_lost_before_the_join(fault_run: MakeRun) -> None:
    """Lane batches are split into 1 KiB parts. Once joined batch ``v - 1`` is out, lane 0's rollout is paused (a
    few seconds, within its lease) so lane 0 cannot publish batch ``v``; lane 1's batch ``v`` arrives and waits
    for it, and one of its parts is deleted. The joiner joins index ``v`` without lane 1's share and tells lane 1,
    whose coordinator counts the groups dropped; later indices proceed."""
    run = fault_run(
        "lane-manifest-part-lost", [f"--total_steps={TOTAL_STEPS}", "--coordinator.manifest_part_kib=1"], lanes=2
    )
    run.start()
    lane0, lane1 = run.lane_sides

    def indices(side: Lane) -> dict[int, BatchManifest]:
        return {m.index: m for m in (decode(f[b"d"], BatchManifest) for _, f in side.client.xrange(side.names.batches))}

    def lose_a_part(version: int) -> str | None:
        """The part of lane 1's batch ``version`` deleted while lane 0's is held back (None: not in time)."""
        run.wait_until(f"joined batch {version - 1}", lambda: run.client.xlen(run.names.batches) >= version, 240)
        run.pause("rollout-0")
        try:
            deadline = time.monotonic() + PAUSE_S
            while time.monotonic() < deadline:
                joined = int(run.client.get(run.names.state("batch_index")) or 0)
                waiting = indices(lane1).get(version)
                if version >= joined and waiting is not None and version not in indices(lane0) and waiting.parts:
                    lane1.client.delete(waiting.parts[0])
                    return waiting.parts[0]
                time.sleep(0.05)
            return None
        finally:
            run.resume("rollout-0")

    lost = next((p for v in range(1, TOTAL_STEPS - 1) if (p := lose_a_part(v)) is not None), None)
    assert lost is not None, "lane 1 never had a batch waiting for lane 0's"
    run.details["lane 1 manifest part deleted"] = lost.rsplit(":", 4)[-4]
    run.wait_until(
        "the joiner's letter to lane 1",
        lambda: any(
            b"of lane 1" in payload and BATCH_SKIPPED.encode() in payload
            for _, payload in run.entries(lane1.names.dead)
        ),
        timeout_s=60,
    )
    row = conclude(
        run,
        "a lane 1 manifest part deleted before the join",
        total_steps=TOTAL_STEPS,
        fault_end=time.time(),
        recovery_bound_s=RECOVERY_BOUND_S,
        run_timeout_s=300,
    )
    assert any(reason.startswith("dead batches") for reason in row.counts.dropped), row.counts.dropped
