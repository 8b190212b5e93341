"""The learner SIGKILLed right after it publishes a version, restarted: generation resumes within seconds of the
version's republication, not at the rollout's weight sync deadline.

The rollout worker is paused (SIGSTOP) from the moment the batch of version ``KILL_AT_VERSION`` is built until
the learner that published that version is dead, so the worker's fetch goes to an endpoint nothing listens on.
``rollout.weight_sync_timeout_s`` keeps its default (120 s): before the fix the worker kept fetching from the dead
endpoint until that deadline while the restarted learner's event for the same version (same weights, another
port) waited behind it. Now the fetch fails at the connect deadline (``CONNECT_TIMEOUT_S``, retried) and a newer
event abandons it at once; the row records how long after the republication the worker served the version.
"""

from __future__ import annotations

import time

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

from streamrl.common.codec import decode
from streamrl.common.messages import WeightsPublished

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
KILL_AT_VERSION = 5
"""An odd version: the learner checkpoints every 2 steps, so the restarted learner trains and publishes it again."""
DOWN_S = 3.0
RESUME_BOUND_S = 10.0
"""From the restarted learner's event for the version to the worker serving it (s); was ~120 s (the sync deadline)."""
RECOVERY_BOUND_S = 45.0
"""From the restart to the next trained batch (s): the model load, the replayed step, the fetch."""


def test_learner_killed_right_after_it_publishes(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("kill-learner-after-publish", [f"--total_steps={TOTAL_STEPS}"]).start()
    run.wait_served(KILL_AT_VERSION - 1)
    run.wait_until(f"batch {KILL_AT_VERSION - 1}", lambda: run.client.xlen(run.names.batches) >= KILL_AT_VERSION, 60)
    run.pause("rollout-0")
    run.wait_version(KILL_AT_VERSION, timeout_s=60)
    run.kill("learner-0")
    run.resume("rollout-0")  # its fetch of the version goes to the dead learner's endpoint
    time.sleep(DOWN_S)
    run.start_service("learner", "learner-0")
    restarted = time.time()
    run.wait_until(
        f"rollout-0 serving version {KILL_AT_VERSION}",
        lambda: run.served().get("rollout-0", -1) >= KILL_AT_VERSION,
        180,
    )
    served_at = time.time()
    events = [
        (int(entry_id.split("-")[0]) / 1000, decode(payload, WeightsPublished))
        for entry_id, payload in run.entries(run.names.weights)
    ]
    of_version = [at for at, event in events if event.version == KILL_AT_VERSION]
    republished_at = of_version[1] if len(of_version) > 1 else None
    resumed_s = None if republished_at is None else round(served_at - republished_at, 2)
    run.details.update(
        republished_after_restart_s=None if republished_at is None else round(republished_at - restarted, 1),
        served_after_republish_s=resumed_s,
        served_after_restart_s=round(served_at - restarted, 1),
    )

    def checks() -> list[str]:
        if republished_at is None:
            return [f"the restarted learner never published version {KILL_AT_VERSION} again ({len(of_version)} events)"]
        if resumed_s is None or resumed_s > RESUME_BOUND_S:
            return [f"rollout-0 served version {KILL_AT_VERSION} {resumed_s} s after its republication"]
        return []

    conclude(
        run,
        "SIGKILL learner right after it publishes",
        total_steps=TOTAL_STEPS,
        fault_end=restarted,
        recovery_bound_s=RECOVERY_BOUND_S,
        checks=checks,
    )
