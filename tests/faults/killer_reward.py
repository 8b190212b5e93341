"""Reward function of the killer-message scenario: scoring one prompt SIGKILLs the reward process.

Scores like examples/arithmetic/task.py (1.0 when the response ends with the label), except that a
batch holding a sample of a prompt listed, one per line, in the file ``$FAULTS_KILLER_FILE`` kills
the process scoring it with SIGKILL (as an out-of-memory kill or a segfault in a scorer would):
every delivery of those trajectories kills their consumer.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

FILE_ENV = "FAULTS_KILLER_FILE"


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    path = Path(os.environ.get(FILE_ENV, "/nonexistent"))
    killers = set(path.read_text().splitlines()) if path.exists() else set()
    if killers & set(prompts):
        os.kill(os.getpid(), signal.SIGKILL)
    scores = [1.0 if label and q.endswith(label) else 0.0 for q, label in zip(queries, labels, strict=True)]
    return {"rewards": scores, "scores": scores}
