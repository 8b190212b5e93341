"""A coordinator whose start-up is slower than its lease's TTL, with a standby waiting.

The training dataset lives on "slow storage": in the coordinators (and only there), reading it takes
``SLOW_S`` seconds longer (tests/faults/slow_read/sitecustomize.py delays ``Path.read_text`` of that
file, the way the coordinator reads a .jsonl dataset), twice the run's ``LEASE_TTL_S`` lease, as a
dataset on a slow network volume would. (6 s, not the default 4 s: inside the whole suite on 2 cores a
renewal was once more than 4 s late and the standby took over - a load failure, not a slow start.) Two coordinators start, both ``standby = true`` (the second one
second after the first). The first takes the run's lease and then reads the dataset; it must keep
its lease through that read (the read off its event loop, or the lease taken after it), so the
standby stays a standby, nobody stops with ``LeaseLostError``, and the run completes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

pytestmark = pytest.mark.slow
TOTAL_STEPS = 8
LEASE_TTL_S = 6.0
SLOW_S = 2 * LEASE_TTL_S
SLOW_READ = Path(__file__).with_name("slow_read")


def test_slow_coordinator_start_with_a_standby(fault_run: MakeRun, tiny_task: Path) -> None:
    dataset = tiny_task / "train.jsonl"
    path = os.pathsep.join([str(SLOW_READ), *filter(None, [os.environ.get("PYTHONPATH", "")])])
    slow = {"PYTHONPATH": path, "FAULTS_SLOW_FILE": str(dataset), "FAULTS_SLOW_READ_S": str(SLOW_S)}
    run: FaultRun = fault_run(
        "slow-start", [f"--total_steps={TOTAL_STEPS}", "--standby=true", f"--consumer.lease_ttl_s={LEASE_TTL_S:g}"]
    )
    run.service_env["coordinator"] = slow
    run.start()
    time.sleep(1.0)
    run.start_service("coordinator", "coordinator-1")
    conclude(
        run,
        f"coordinator start slower than its lease ({SLOW_S:g} s) + standby",
        total_steps=TOTAL_STEPS,
        fault_end=None,
        recovery_bound_s=None,
    )
