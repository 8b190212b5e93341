"""Reward function of the invalid-rewards scenario: NaN for about 5% of samples, the rest scored.

Scores like examples/arithmetic/task.py (1.0 when the response ends with the label), except that a
sample whose query (prompt + response text) hashes to 0 modulo 20 gets NaN - the same answer on every
delivery, as a buggy reward function gives. Each NaN answer appends its query to the file
``$FAULTS_NAN_FILE`` (one JSON string a line), so the scenario knows which samples were bad.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

FILE_ENV = "FAULTS_NAN_FILE"
ONE_IN = 20
"""One sample in this many (by its query's CRC-32) is answered NaN."""


def is_bad(query: str) -> bool:
    return zlib.crc32(query.encode()) % ONE_IN == 0


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    rewards = [
        float("nan") if is_bad(q) else 1.0 if label and q.endswith(label) else 0.0
        for q, label in zip(queries, labels, strict=True)
    ]
    bad = [q for q in queries if is_bad(q)]
    if bad and os.environ.get(FILE_ENV):
        with open(os.environ[FILE_ENV], "a") as f:
            f.write("".join(json.dumps(q) + "\n" for q in bad))
    return {"rewards": rewards, "scores": rewards}
