"""A follower rank of a two-rank learner SIGKILLed while a step is under way (an out-of-memory kill).

``learner.ranks = 2``: rank 0 is on the bus, rank 1 follows its commands (streamrl.learner.rl.group).
Once the run is at ``KILL_AT_VERSION`` and a batch is waiting to be trained or being trained, rank 1
is SIGKILLed. The group cannot go on without it: the learner must stop (loudly, not hang in a
collective), the orchestrator restarts it (an allowed learner exit), both ranks resume from the last
checkpoint, and the run ends with nothing lost and nothing trained twice.
"""

from __future__ import annotations

import time

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

pytestmark = pytest.mark.slow
TOTAL_STEPS = 10
KILL_AT_VERSION = 3
RECOVERY_BOUND_S = 90.0
"""From the kill to the next trained batch (s): the group notices, stops, restarts (two ranks load the
model on two cores) and replays what its checkpoint does not cover."""


STALL_S = 150.0
"""Nothing moves while the group restarts: two ranks start DeepSpeed on a busy 2-core machine (45 s
and more at b2e4606, when the default stall limit called the restart a wedge)."""


def test_follower_rank_killed_mid_step(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("learner-rank-killed", [f"--total_steps={TOTAL_STEPS}", "--learner.ranks=2"]).start()
    run.wait_version(KILL_AT_VERSION, timeout_s=240)
    batches = run.names.batches
    run.wait_until("a batch waiting for the learner", lambda: len(run.tap.entries(batches)) > run.version(), 60)
    pid = run.kill_rank("learner-0", 1)
    killed = time.time()
    run.details.update(killed_pid=pid, killed_at_version=run.version())
    conclude(
        run,
        "SIGKILL learner rank 1 of 2 mid-step",
        total_steps=TOTAL_STEPS,
        fault_end=killed,
        recovery_bound_s=RECOVERY_BOUND_S,
        allowed_exits=("learner",),
        run_timeout_s=300,
        stall_s=STALL_S,
    )
