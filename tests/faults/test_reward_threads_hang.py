"""A reward function that hangs: every thread of the reward worker held by a call that never returns.

tests/faults/hanging_reward.py blocks for ever (never returns, never raises) whenever a batch it
scores holds a sample of the 11th training prompt (the dataset is read in order, so the prompt is
known before the run). Each such call times out after ``timeout_s`` but keeps its thread; with
``max_threads`` threads held that way the worker can score nothing more. It must not wedge with a
healthy heartbeat (issue 38, finding 2): it exits with status 1, leaving what it holds pending, and
the orchestrator (the harness's supervisor) restarts it under the same name. The prompt's entries
are dead-lettered once delivered ``consumer.max_deliveries`` times (timed out and not started again
while their call runs, or "killed its consumer N times" when each delivery ended with an exit), their
group is replaced, and the run reaches its last step: a few reward exits, not a crash loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hanging_reward import FILE_ENV
from harness import FaultRun, MakeRun
from scenario import conclude

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import DeadLetter, Trajectory, TrajectoryRecord

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
HANGING_PROMPT = 10
MAX_DELIVERIES = 3
GROUP_SIZE = 4
"""recipes/smoke.toml's: the hanging prompt has this many trajectories, read together or apart."""
TIMEOUT_S = 3.0
"""The function scorer's ``timeout_s``: a call past it fails, its thread runs on."""
MAX_THREADS = 2
"""The function scorer's ``max_threads``: two calls that never return and the worker can score nothing more."""
CLAIM_IDLE_MS = 10_000
RECOVERY_BOUND_S = 45.0
"""From the hanging prompt's first dead letter to the next trained batch (s)."""
REWARD_FILE = Path(__file__).with_name("hanging_reward.py")
EXHAUSTED = "threads is held by a call that timed out"
"""What the worker's last words say (streamrl.reward.threads)."""


def _dead_trajectories(run: FaultRun) -> dict[str, list[DeadLetter]]:
    """Group id -> the dead letters of its trajectories."""
    out: dict[str, list[DeadLetter]] = {}
    for _, payload in run.tap.entries(run.names.dead):
        try:
            letter = decode(payload, DeadLetter)
            inner = decode(letter.payload)
        except PoisonMessageError:
            continue
        if isinstance(inner, Trajectory | TrajectoryRecord):
            out.setdefault(inner.group_id, []).append(letter)
    return out


def _hung_letters(run: FaultRun, group: str) -> list[DeadLetter]:
    return _dead_trajectories(run).get(group, [])


def test_a_reward_function_that_hangs(fault_run: MakeRun, tiny_task: Path, tmp_path: Path) -> None:
    rows = (tiny_task / "train.jsonl").read_text().splitlines()
    hanging = tmp_path / "hanging_prompts.txt"
    hanging.write_text(json.loads(rows[HANGING_PROMPT])["prompt"] + "\n")
    group = f"p{HANGING_PROMPT}"
    scorer = {
        "name": "arithmetic",
        "type": "function",
        "path": str(REWARD_FILE),
        "timeout_s": TIMEOUT_S,
        "max_threads": MAX_THREADS,
    }
    overrides = [
        f"--total_steps={TOTAL_STEPS}",
        "--coordinator.dataset.shuffle=false",
        f"--consumer.max_deliveries={MAX_DELIVERIES}",
        f"--consumer.claim_idle_ms={CLAIM_IDLE_MS}",
        f"--reward.scorers={json.dumps([scorer])}",
    ]
    run: FaultRun = fault_run("reward-threads-hang", overrides, env={FILE_ENV: str(hanging)}).start()
    run.wait_until(f"a dead letter of {group}'s trajectories", lambda: bool(_hung_letters(run, group)), 180)
    dead_at = min(letter.ts for letter in _hung_letters(run, group))

    def checks() -> list[str]:
        failures = []
        letters = _hung_letters(run, group)
        run.details["dead_letters_of_group"] = len(letters)
        run.details["reasons"] = sorted({letter.error[:120] for letter in letters})
        # Not a failure (yet): an innocent trajectory in flight through max_deliveries of these exits is
        # dead-lettered as "killed its consumer" with them, and its group replaced (see docs/faults.md).
        run.details["other_groups_dead"] = {
            g: [letter.error[:80] for letter in dead] for g, dead in _dead_trajectories(run).items() if g != group
        }
        early = [letter for letter in letters if letter.deliveries < MAX_DELIVERIES]
        if early:
            failures.append(
                f"{len(early)} of {group}'s entries dead-lettered after {early[0].deliveries} deliveries "
                f"(max_deliveries {MAX_DELIVERIES}): {early[0].error[:160]!r}"
            )
        exits = [e for e in run.exits if e.instance.startswith("reward")]
        run.details["reward_exits"] = len(exits)
        run.details["reward_exit_codes"] = sorted({e.code for e in exits})
        if not exits:
            failures.append("the reward worker never exited: its threads all hung and it went on (wedged?)")
        if any(e.code != 1 for e in exits):
            failures.append("a reward exit other than status 1: " + " || ".join(str(e) for e in exits if e.code != 1))
        if exits and not any(EXHAUSTED in e.log_tail for e in exits):
            failures.append(f"no reward exit says {EXHAUSTED!r}: {exits[0]}")
        if len(exits) > MAX_DELIVERIES * GROUP_SIZE:  # each hanging entry ends at most max_deliveries lives
            failures.append(
                f"the reward service exited {len(exits)} times (max_deliveries {MAX_DELIVERIES}): a crash loop"
            )
        return failures

    row = conclude(
        run,
        "reward function hangs, every thread held (reward)",
        total_steps=TOTAL_STEPS,
        fault_end=dead_at,
        recovery_bound_s=RECOVERY_BOUND_S,
        allowed_exits=("reward",),
        checks=checks,
        run_timeout_s=240,
    )
    assert row.counts.dropped, f"{group} was dead-lettered but no group counted as dropped (replaced)"
