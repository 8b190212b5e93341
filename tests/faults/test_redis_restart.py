"""redis-server SIGKILLed mid-run and started again 3 s later on the same port with its AOF
(``appendfsync always``): every service rides out the outage (none exits), and the run finishes
from the persisted streams and state with nothing lost and nothing trained twice."""

from __future__ import annotations

import time

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
KILL_AT_VERSION = 5
DOWN_S = 3.0
RECOVERY_BOUND_S = 30.0
"""From redis answering again to the next trained batch (s): the clients back off up to 2 s between tries."""


def test_redis_killed_and_restarted(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("redis-restart", [f"--total_steps={TOTAL_STEPS}"]).start()
    run.wait_version(KILL_AT_VERSION)
    run.kill_redis()
    time.sleep(DOWN_S)
    run.start_redis()
    back = time.time()
    conclude(
        run,
        f"redis SIGKILL, back after {DOWN_S:g} s (AOF)",
        total_steps=TOTAL_STEPS,
        fault_end=back,
        recovery_bound_s=RECOVERY_BOUND_S,
    )
