"""SIGKILL of each service mid-run, restarted a few seconds later: nothing lost, nothing twice.

The coordinator and the learner come back under their own name (one per run: their state and
their consumer name are the run's); a rollout or reward worker comes back under a new instance
name, as a replacement pod would, so its predecessor's pending entries must be taken over. Each is
killed once the rollout worker serves version 5 (the learner's newest).

One more learner case: killed after publishing a version that no rollout worker has fetched yet
(the worker is paused with SIGSTOP from the moment the batch is built until the learner is dead,
then resumed): the worker must still get a version to serve and the run must finish.
"""

from __future__ import annotations

import time

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
KILL_AT_VERSION = 5
"""An odd version: the learner checkpoints every 2 steps, so a killed learner has a step to redo."""
DOWN_S = 3.0
RECOVERY_BOUND_S = {"coordinator": 30.0, "rollout": 30.0, "reward": 30.0, "learner": 45.0}
"""From the restart to the next trained batch (s). A restarted learner or rollout worker loads the
model first (~12 s here with four services on two cores); the learner then replays the batches its
last checkpoint does not cover."""


@pytest.mark.parametrize("service", ["coordinator", "rollout", "reward", "learner"])
def test_sigkill_and_restart(service: str, fault_run: MakeRun) -> None:
    run: FaultRun = fault_run(f"kill-{service}", [f"--total_steps={TOTAL_STEPS}"]).start()
    run.wait_served(KILL_AT_VERSION)
    run.kill(f"{service}-0")
    time.sleep(DOWN_S)
    run.start_service(service, f"{service}-0" if service in ("coordinator", "learner") else f"{service}-1")
    restarted = time.time()
    conclude(
        run,
        f"SIGKILL {service}",
        total_steps=TOTAL_STEPS,
        fault_end=restarted,
        recovery_bound_s=RECOVERY_BOUND_S[service],
    )


SYNC_DEADLINE_S = 10.0
"""``rollout.weight_sync_timeout_s`` in the unfetched-version case: the worker's fetch from the dead
learner's endpoint fails only at this deadline, then it takes the version the restarted learner
publishes again (recovery within about the restart, one deadline and the retrained step)."""


def test_learner_killed_before_its_last_version_is_fetched(fault_run: MakeRun) -> None:
    overrides = [f"--total_steps={TOTAL_STEPS}", f"--rollout.weight_sync_timeout_s={SYNC_DEADLINE_S}"]
    run: FaultRun = fault_run("kill-learner-unfetched", overrides).start()
    run.wait_served(KILL_AT_VERSION - 1)
    # the batch the learner trains into version KILL_AT_VERSION is built: pause the worker before it
    # can fetch that version, and kill the learner once it is published
    run.wait_until(f"batch {KILL_AT_VERSION - 1}", lambda: run.client.xlen(run.names.batches) >= KILL_AT_VERSION, 60)
    run.pause("rollout-0")
    run.wait_version(KILL_AT_VERSION, timeout_s=60)
    run.kill("learner-0")
    run.resume("rollout-0")
    time.sleep(DOWN_S)
    run.start_service("learner", "learner-0")
    restarted = time.time()
    conclude(
        run,
        "SIGKILL learner, its last version unfetched",
        total_steps=TOTAL_STEPS,
        fault_end=restarted,
        recovery_bound_s=RECOVERY_BOUND_S["learner"],
    )
