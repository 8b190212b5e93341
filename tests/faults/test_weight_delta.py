"""A rollout worker that missed more versions than the learner keeps deltas for gets a full sync.

Two rollout workers take the learner's versions over the ZMQ/stream path. The learner trains in bf16
at a small learning rate (5e-6, ``gpu_arithmetic``'s: a few % of the bf16 words change per step) on
rewards that are 0 or 1 by the sample's hash (tests/faults/noisy_reward.py), so a worker that holds
the previous version gets each new one as a delta. Once both serve version
``PAUSE_AT_VERSION``, ``rollout-1`` is frozen (SIGSTOP) until the learner has published more than
``max_behind`` (4) versions past it; resumed, its staging buffer still holds a verified version, but no
delta chain reaches back that far: it must get the full weights (its log says so), and the run must
finish with nothing lost, while ``rollout-0``, which stayed current, took deltas throughout.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude

from streamrl.common.weights.wire import DEFAULT_MAX_BEHIND

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
PAUSE_AT_VERSION = 2
RESUME_AT_VERSION = PAUSE_AT_VERSION + DEFAULT_MAX_BEHIND + 2
REWARD_FILE = Path(__file__).with_name("noisy_reward.py")
"""Rewards 0 or 1 by the query's hash: the tiny random model's weights move every step (it earns nothing
from the arithmetic task, so its weights would not change at all)."""
RECOVERY_BOUND_S = 30.0
"""From the resume to the next trained batch (s)."""
DELTA_LINE = re.compile(r"weights version (\d+) \(full\): delta from version (\d+)")
FULL_LINE = re.compile(r"weights version (\d+) \(full\): full, \d+ bytes received \((.*)\)")


def _syncs(run: FaultRun, instance: str) -> tuple[list[tuple[int, int]], list[tuple[int, str]]]:
    """(version, base) of each delta and (version, reason) of each full sync in ``instance``'s log."""
    text = run.procs[instance].log.read_text(errors="replace")
    deltas = [(int(v), int(b)) for v, b in DELTA_LINE.findall(text)]
    fulls = [(int(v), reason) for v, reason in FULL_LINE.findall(text)]
    return deltas, fulls


def test_a_worker_that_missed_versions_gets_a_full_sync(fault_run: MakeRun) -> None:
    overrides = [
        f"--total_steps={TOTAL_STEPS}",
        "--learner.ds.dtype=bf16",
        "--learner.ds.lr=5e-6",
        f"--learner.weights_delta_max_behind={DEFAULT_MAX_BEHIND}",
        f"--reward.scorers={json.dumps([{'name': 'noisy', 'type': 'function', 'path': str(REWARD_FILE)}])}",
    ]
    run: FaultRun = fault_run("weights-delta", overrides).start()
    run.start_service("rollout", "rollout-1")
    run.wait_served(PAUSE_AT_VERSION)
    run.pause("rollout-1")
    run.wait_version(RESUME_AT_VERSION, timeout_s=150)
    run.resume("rollout-1")
    resumed = time.time()

    def checks() -> list[str]:
        failures = []
        deltas, fulls = _syncs(run, "rollout-1")
        missed = [(v, r) for v, r in fulls if v >= RESUME_AT_VERSION]
        if not missed or "too far behind" not in missed[0][1]:
            failures.append(f"rollout-1 resumed without a full sync for being too far behind: full {fulls}")
        run.details["rollout-1"] = {"deltas": len(deltas), "full": fulls}
        deltas, fulls = _syncs(run, "rollout-0")
        run.details["rollout-0"] = {"deltas": len(deltas), "full": fulls}
        if len(deltas) < TOTAL_STEPS // 2 or any(v != b + 1 for v, b in deltas):
            failures.append(f"rollout-0 took {len(deltas)} one-step deltas (full syncs: {fulls})")
        return failures

    conclude(
        run,
        f"a worker frozen {DEFAULT_MAX_BEHIND + 2} versions (max_behind {DEFAULT_MAX_BEHIND})",
        total_steps=TOTAL_STEPS,
        fault_end=resumed,
        recovery_bound_s=RECOVERY_BOUND_S,
        checks=checks,
    )
