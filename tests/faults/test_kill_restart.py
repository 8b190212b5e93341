"""SIGKILL of each service mid-run, restarted a few seconds later: nothing lost, nothing twice.

The coordinator and the learner come back under their own name (one per run: their state and
their consumer name are the run's); a rollout or reward worker comes back under a new instance
name, as a replacement pod would, so its predecessor's pending entries must be taken over.
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
    run.wait_version(KILL_AT_VERSION)
    run.kill(f"{service}-0")
    time.sleep(DOWN_S)
    run.start_service(service, f"{service}-0" if service in ("coordinator", "learner") else f"{service}-1")
    restarted = time.time()
    conclude(run, f"SIGKILL {service}", total_steps=TOTAL_STEPS, fault_end=restarted,
             recovery_bound_s=RECOVERY_BOUND_S[service])  # fmt: skip
