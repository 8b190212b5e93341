"""Reward function of the reward-threads-hang scenario: scoring one prompt never returns.

Scores like examples/arithmetic/task.py (1.0 when the response ends with the label), except that a
call on a batch holding a sample of a prompt listed, one per line, in the file ``$FAULTS_HANG_FILE``
blocks for ever (as a scorer stuck on a lock, a dead socket without a time-out or a pathological
regex would): its thread is never given back. The reward worker's threads for this function
(``max_threads``) are each held in turn by such calls until it can score nothing more.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

FILE_ENV = "FAULTS_HANG_FILE"


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    path = Path(os.environ.get(FILE_ENV, "/nonexistent"))
    hanging = set(path.read_text().splitlines()) if path.exists() else set()
    if hanging & set(prompts):
        threading.Event().wait()  # never set: this call never returns
    scores = [1.0 if label and q.endswith(label) else 0.0 for q, label in zip(queries, labels, strict=True)]
    return {"rewards": scores, "scores": scores}
