"""Reward function of the non-finite-loss scenario: a reward so large the learner's loss overflows.

Scores like examples/arithmetic/task.py (1.0 when the response ends with the label), except for the
prompts listed, one per line, in the file ``$FAULTS_HUGE_REWARD_FILE`` (read on every call, so the
scenario can name a prompt while the run goes on): every sample of those gets reward 3e38. That is
a finite float - the reward tier passes it on, as it would a buggy scorer's - and with the learner's
reward clipping off the group's reward sum overflows float32, so its GRPO advantages, and the
step's loss, are NaN.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

HUGE_REWARD = 3e38
FILE_ENV = "FAULTS_HUGE_REWARD_FILE"


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    path = Path(os.environ.get(FILE_ENV, "/nonexistent"))
    huge = set(path.read_text().splitlines()) if path.exists() else set()
    scores = [1.0 if label and q.endswith(label) else 0.0 for q, label in zip(queries, labels, strict=True)]
    rewards = [HUGE_REWARD if p in huge else s for p, s in zip(prompts, scores, strict=True)]
    return {"rewards": rewards, "scores": scores}
