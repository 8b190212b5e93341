"""A remote reward service with a slow tail: generation must not be thrown away for it.

The reward tier scores through the HTTP scorer against tests/faults/scorer_server.py in its ``tail``
mode - one request in ten (``SLOW_FRACTION``) answers after ``SLOW_S`` (1 s), the others at once -
for the whole run, at the demo's in-flight settings and step shape (32 groups of 8 samples, one step
of staleness: test_remote_reward.py's ``DEMO_IN_FLIGHT``). A group with a sample in a slow request
completes late, behind groups issued after it. The run must reach its last step with nothing lost or
trained twice, and less than ``MAX_WASTE`` of the training samples generated may be dropped as too
stale (before the batch builder waited for such a group, 17.8% were: docs/design.md section 4). The
row's details give the figure (``too_stale_pct``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude
from scorer_server import ScorerServer
from test_remote_reward import DEMO_IN_FLIGHT, GROUP_SIZE

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import Trajectory, TrajectoryRecord
from streamrl.ops.redis_server import free_port

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
SLOW_FRACTION = 0.1
SLOW_S = 1.0
MAX_WASTE = 0.01
"""Largest share of the generated training samples that may be dropped as too stale."""


@pytest.fixture
def tail_scorer(tmp_path: Path) -> Iterator[ScorerServer]:
    server = ScorerServer(free_port(), tmp_path / "scorer.log").start()
    server.set_mode("tail", slow_s=SLOW_S, slow_fraction=SLOW_FRACTION)
    yield server
    server.kill()


def _generated(run: FaultRun) -> int:
    """Training trajectories the rollout tier wrote (unique ids)."""
    ids = set()
    for _, fields in run.written(run.names.trajectories):
        try:
            m = decode(fields.get(b"d", b""))
        except PoisonMessageError:
            continue
        if isinstance(m, Trajectory | TrajectoryRecord) and not m.is_eval:
            ids.add(m.id)
    return len(ids)


def test_reward_slow_tail_wastes_no_generation(tail_scorer: ScorerServer, fault_run: MakeRun) -> None:
    scorer_cfg = {"name": "remote", "type": "http", "urls": [tail_scorer.url], "timeout_s": 10.0}
    overrides = [f"--total_steps={TOTAL_STEPS}", *DEMO_IN_FLIGHT, f"--reward.scorers={json.dumps([scorer_cfg])}"]
    run = fault_run("reward-tail", overrides).start()

    def checks() -> list[str]:
        stats = tail_scorer.stats()
        too_stale = int(run.client.get(run.names.state("samples_too_stale")) or 0)
        generated = _generated(run)
        share = too_stale / max(generated, 1)
        run.details.update(
            requests=stats.get("tail", 0),
            slow_requests=stats.get("slowed", 0),
            generated=generated,
            too_stale_samples=too_stale,
            too_stale_pct=round(100 * share, 2),
        )
        failures = [] if stats.get("slowed") else ["no request was slow"]
        if share >= MAX_WASTE:
            failures.append(
                f"{too_stale} of {generated} generated samples ({100 * share:.1f}%) dropped as too stale "
                f"(bound {100 * MAX_WASTE:g}%)"
            )
        return failures

    conclude(
        run,
        f"reward slow tail ({100 * SLOW_FRACTION:g}% of requests {SLOW_S:g} s, demo in-flight)",
        total_steps=TOTAL_STEPS,
        group_size=GROUP_SIZE,
        fault_end=None,
        recovery_bound_s=None,
        checks=checks,
    )
