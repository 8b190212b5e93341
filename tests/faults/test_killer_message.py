"""A message that kills its consumer: scoring one prompt SIGKILLs the reward process, every time.

tests/faults/killer_reward.py kills the reward process (SIGKILL, as an out-of-memory kill or a
segfault would) whenever a batch it scores holds a sample of the 11th training prompt (the dataset is
read in order, so the prompt is known before the run). The orchestrator (the harness's supervisor)
restarts the reward service under the same name each time, and it reads its pending entries again.
The consumer loop must count those deliveries before handling an entry: once an entry has been
delivered more than ``consumer.max_deliveries`` times it is dead-lettered ("killed its consumer N
times") instead of being handled again, its group is replaced, and the run ends: a few reward exits
(at most max_deliveries for each of the prompt's trajectories, read together or apart), not a crash loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import FaultRun, MakeRun
from killer_reward import FILE_ENV
from scenario import conclude

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import DeadLetter, Trajectory, TrajectoryRecord

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
KILLER_PROMPT = 10
MAX_DELIVERIES = 3
GROUP_SIZE = 4
"""recipes/smoke.toml's: the killer prompt has this many trajectories, read together or apart."""
CLAIM_IDLE_MS = 10_000
RECOVERY_BOUND_S = 45.0
"""From the killer's dead letter to the next trained batch (s)."""
REWARD_FILE = Path(__file__).with_name("killer_reward.py")
REASON = "killed its consumer"


def _killer_letters(run: FaultRun, group: str) -> list[DeadLetter]:
    out = []
    for _, payload in run.tap.entries(run.names.dead):
        try:
            letter = decode(payload, DeadLetter)
            inner = decode(letter.payload)
        except PoisonMessageError:
            continue
        if isinstance(inner, Trajectory | TrajectoryRecord) and inner.group_id == group:
            out.append(letter)
    return out


def test_a_message_that_kills_its_consumer(fault_run: MakeRun, tiny_task: Path, tmp_path: Path) -> None:
    rows = (tiny_task / "train.jsonl").read_text().splitlines()
    killers = tmp_path / "killer_prompts.txt"
    killers.write_text(json.loads(rows[KILLER_PROMPT])["prompt"] + "\n")
    group = f"p{KILLER_PROMPT}"
    scorer = {"name": "arithmetic", "type": "function", "path": str(REWARD_FILE)}
    overrides = [
        f"--total_steps={TOTAL_STEPS}",
        "--coordinator.dataset.shuffle=false",
        f"--consumer.max_deliveries={MAX_DELIVERIES}",
        f"--consumer.claim_idle_ms={CLAIM_IDLE_MS}",
        f"--reward.scorers={json.dumps([scorer])}",
    ]
    run: FaultRun = fault_run("killer-message", overrides, env={FILE_ENV: str(killers)}).start()
    run.wait_until(f"a dead letter of {group}'s trajectories", lambda: bool(_killer_letters(run, group)), 180)
    dead_at = min(letter.ts for letter in _killer_letters(run, group))

    def checks() -> list[str]:
        failures = []
        letters = _killer_letters(run, group)
        if not any(REASON in letter.error for letter in letters):
            failures.append(f"{group} was dead-lettered without {REASON!r}: {letters[0].error[:160]!r}")
        kills = [e for e in run.exits if e.instance.startswith("reward")]
        run.details["reward_exits"] = len(kills)
        if len(kills) > MAX_DELIVERIES * GROUP_SIZE:  # each killer entry kills at most max_deliveries times
            failures.append(
                f"the reward service died {len(kills)} times (max_deliveries {MAX_DELIVERIES}): a crash loop"
            )
        return failures

    conclude(
        run,
        "message SIGKILLs its consumer (reward)",
        total_steps=TOTAL_STEPS,
        fault_end=dead_at,
        recovery_bound_s=RECOVERY_BOUND_S,
        allowed_exits=("reward",),
        checks=checks,
        run_timeout_s=240,
    )
