"""``streamrl learner`` for test_learner_group_failures.py, with one rank failing in one batch's step.

Run like ``python -m streamrl.learner RECIPE --burst``: without ``RANK`` it is the launcher
(:func:`streamrl.learner.rl.group.launch`, which starts this file for every rank), with it a rank.
On rank ``FAIL_RANK``, the policy forward of batch ``FAIL_INDEX`` fails before any backward pass:
``FAIL_MODE=raise`` raises an out-of-memory error (as a GPU out of memory, or bad data, would) and
``FAIL_MODE=kill`` ends the process with exit code 9 (as an OOM-kill or a segfault would).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from streamrl.common.messages import TrainingBatch
from streamrl.learner.__main__ import _configured_ranks
from streamrl.learner.__main__ import main as learner_main
from streamrl.learner.rl.trainer import RLTrainer


def inject(rank: int, index: int, mode: str) -> None:
    current = [-1]
    real_step, real_logprobs = RLTrainer.step, RLTrainer._logprobs

    def step(self: RLTrainer, batch: TrainingBatch) -> dict[str, float]:
        current[0] = batch.index
        return real_step(self, batch)

    def logprobs(self: RLTrainer, engine: Any, mb: Any, with_entropy: bool) -> Any:
        if self.rank == rank and current[0] == index:
            if mode == "kill":
                os._exit(9)
            raise RuntimeError(f"CUDA out of memory (simulated) in batch {index}")
        return real_logprobs(self, engine, mb, with_entropy)

    RLTrainer.step = step  # type: ignore[method-assign]
    RLTrainer._logprobs = logprobs  # type: ignore[method-assign]


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "RANK" not in os.environ:
        from streamrl.learner.rl.group import launch

        sys.exit(launch(_configured_ranks(argv), argv, command=[sys.executable, __file__]))
    inject(int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_INDEX"]), os.environ["FAIL_MODE"])
    sys.exit(learner_main(argv))
