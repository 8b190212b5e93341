"""A reward model's forward has a deadline: one that never returns fails its batch with the reason and stops the
worker (to be restarted) instead of leaving every later batch waiting behind it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from streamrl.common.aio import timeout
from streamrl.common.messages import Trajectory
from streamrl.reward.config import ModelScorerConfig
from streamrl.reward.scorers import ScorerError
from streamrl.reward.scorers.model import ModelScorer


class _WedgedModel:
    def __init__(self) -> None:
        self.release = threading.Event()

    def score_texts(self, texts: list[str]) -> list[float]:
        self.release.wait()
        return [0.0] * len(texts)


def test_a_forward_that_never_returns_fails_its_batch_and_stops_the_worker(traj: Callable[..., Trajectory]) -> None:
    model = _WedgedModel()
    told: list[str] = []
    config = ModelScorerConfig(name="rm", path="unused", timeout_s=0.2)
    scorer = ModelScorer(config, model=model, on_exhausted=told.append)  # type: ignore[arg-type]

    async def main() -> Any:
        async with timeout(5.0):
            with pytest.raises(ScorerError, match=r"model scorer 'rm': a forward of 1 samples timed out after 0\.2 s"):
                await scorer.score([traj(0)])
            with pytest.raises(asyncio.CancelledError):  # the worker is stopping: the entry stays pending
                await scorer.score([traj(0)])

    asyncio.run(main())
    model.release.set()
    assert told == [
        "model scorer 'rm': every one of its 1 threads is held by a call that timed out and has not returned"
    ]
