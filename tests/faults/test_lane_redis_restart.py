"""A run on two lanes (:mod:`streamrl.common.lanes`): two coordinators over the prompt shards, a rollout and a
reward replica per lane, one learner training the joined batches. Lane 1's redis-server is SIGKILLed mid-run and
started again on the same port with its AOF (``appendfsync always``): every service rides out the outage, and the
run reaches ``total_steps`` with every issued group of both lanes trained exactly once and nothing pending."""

from __future__ import annotations

import time

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

pytestmark = pytest.mark.slow
TOTAL_STEPS = 8
KILL_AT_VERSION = 3
DOWN_S = 3.0
RECOVERY_BOUND_S = 45.0
"""From the lane's redis answering again to the next trained batch (s)."""


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
