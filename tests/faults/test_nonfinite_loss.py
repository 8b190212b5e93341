"""A non-finite loss: one prompt's rewards overflow the learner's float32 advantages (NaN loss).

tests/faults/huge_reward.py gives 3e38 to every sample of the 11th training prompt (the dataset is
read in order here, so that prompt is known before the run starts; it lands in the third batch), and
the learner's reward clipping is off (``learner.algo.shaping.reward_clip = null``, as a user who wants
raw rewards sets it): the group's float32 reward sum overflows, its GRPO advantages and the step's
loss are NaN. The batch holding that group
cannot be trained: the learner must give it up with a reason (dead-lettered, its groups counted as
dropped) and the run must still reach its last step. A learner that stops on a step failing after a
backward pass (its documented behaviour) is restarted by the orchestrator: that exit is allowed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from accounting import batch_members
from harness import FaultRun, MakeRun
from huge_reward import FILE_ENV
from scenario import conclude

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import BatchManifest, DeadLetter, TrainingBatch

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
POISONED_PROMPT = 10
RECOVERY_BOUND_S = 45.0
"""From the first dead letter of the poisoned batch to the next trained batch (s); a learner that
stopped on it loads again first."""
REWARD_FILE = Path(__file__).with_name("huge_reward.py")


def _batch_dead_letters(run: FaultRun, group: str) -> list[DeadLetter]:
    out = []
    for _, fields in run.written(run.names.dead):
        try:
            letter = decode(fields.get(b"d", b""), DeadLetter)
            inner = decode(letter.payload)
        except PoisonMessageError:
            continue
        if isinstance(inner, TrainingBatch | BatchManifest) and group in {g for _, g in batch_members(inner)}:
            out.append(letter)
    return out


def test_nonfinite_loss(fault_run: MakeRun, tiny_task: Path, tmp_path: Path) -> None:
    rows = (tiny_task / "train.jsonl").read_text().splitlines()
    huge = tmp_path / "huge_prompts.txt"
    huge.write_text(json.loads(rows[POISONED_PROMPT])["prompt"] + "\n")
    group = f"p{POISONED_PROMPT}"
    scorer = {"name": "arithmetic", "type": "function", "path": str(REWARD_FILE)}
    overrides = [
        f"--total_steps={TOTAL_STEPS}",
        "--coordinator.dataset.shuffle=false",
        "--learner.algo.shaping.reward_clip=null",
        f"--reward.scorers={json.dumps([scorer])}",
    ]
    run: FaultRun = fault_run("nonfinite", overrides, env={FILE_ENV: str(huge)}).start()
    run.wait_until(f"a dead letter of the batch holding {group}", lambda: bool(_batch_dead_letters(run, group)), 120)
    dead_at = min(letter.ts for letter in _batch_dead_letters(run, group))

    def checks() -> list[str]:
        letters = _batch_dead_letters(run, group)
        if not any("finite" in letter.error for letter in letters):
            return [
                f"the poisoned batch was dead-lettered without naming the non-finite loss: {letters[0].error[:160]!r}"
            ]
        return []

    conclude(
        run,
        "non-finite loss (3e38 reward)",
        total_steps=TOTAL_STEPS,
        fault_end=dead_at,
        recovery_bound_s=RECOVERY_BOUND_S,
        allowed_exits=("learner",),
        checks=checks,
    )
