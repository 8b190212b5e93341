"""A scorer answer unusable for some samples (NaN, inf, not a number, a list of the wrong length) costs those
samples only: failed alone (``reward.on_invalid = "dead_letter"``) or scored ``reward.invalid_value``."""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from pydantic import ValidationError

from streamrl.common.bus import Output
from streamrl.common.messages import ScoredTrajectory, Tensor, Trajectory, TrajectoryRecord
from streamrl.common.payloads import record_of
from streamrl.common.streams import StreamNames
from streamrl.reward.config import FunctionScorerConfig, ModelScorerConfig, RewardConfig
from streamrl.reward.scorers.base import ScorerError, ScorerResult, parse_reward_output
from streamrl.reward.scorers.function import FunctionScorer
from streamrl.reward.scorers.model import ModelScorer
from streamrl.reward.service import INVALID_LOG_EVERY, RewardService

BAD = "bad"
"""The response text the reward functions below answer badly for."""


def _config(**kw: Any) -> RewardConfig:
    return RewardConfig(scorers=[{"type": "function", "name": "fn", "path": "unused.py"}], max_wait_ms=20, **kw)


def _service(func: Callable[..., Any], **kw: Any) -> RewardService:
    scorer = FunctionScorer(FunctionScorerConfig(name="fn", path="unused.py"), func=func)
    return RewardService(_config(**kw), StreamNames("r"), scorers=[scorer])


def _handle_all(service: RewardService, batch: list[Trajectory]) -> list[list[Output] | BaseException]:
    async def main() -> list[list[Output] | BaseException]:
        try:
            return await asyncio.gather(*(service.handle(t) for t in batch), return_exceptions=True)
        finally:
            await service.close()

    return asyncio.run(main())


def _batch(traj: Callable[..., Trajectory], n: int = 8, bad: tuple[int, ...] = (3,)) -> list[Trajectory]:
    return [traj(i, response=BAD if i in bad else f"answer {i}") for i in range(n)]


def _answer(value: Any, where: str = "rewards") -> Callable[..., dict[str, Any]]:
    """A reward function answering 1.0 per sample, ``value`` in ``where`` for the samples whose response is BAD."""

    def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict[str, Any]:
        values = [value if q.endswith(BAD) else 1.0 for q in queries]
        if where == "rewards":
            return {"rewards": values}
        if where == "scores":
            return {"rewards": [1.0] * len(queries), "scores": values}
        return {"rewards": [1.0] * len(queries), "extra_logs": {"k": values}}

    return reward_func


@pytest.mark.parametrize(
    ("value", "where", "reason"),
    [
        (math.nan, "rewards", "reward is nan"),
        (math.inf, "rewards", "reward is inf"),
        ("oops", "rewards", "rewards is not a number: 'oops'"),
        (None, "rewards", "rewards is not a number: None"),
        (math.nan, "scores", "score is nan"),
        (-math.inf, "extra_logs", r"extra_logs\['k'\] is -inf"),
        ([1.0, 2.0], "extra_logs", r"extra_logs\['k'\] is not a number: \[1.0, 2.0\]"),
    ],
)
def test_an_unusable_value_fails_only_its_sample(
    traj: Callable[..., Trajectory], value: Any, where: str, reason: str
) -> None:
    """Before, one NaN raised a ScorerError for the whole call: every sample of the micro-batch was retried,
    dead-lettered and its group replaced."""
    service = _service(_answer(value, where))
    outcomes = _handle_all(service, _batch(traj))
    failed = [i for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
    assert failed == [3]
    error = outcomes[3]
    assert isinstance(error, ScorerError)
    message = str(error)
    assert "g0/3" in message and "scorer 'fn'" in message and "reward.on_invalid" in message
    assert re.search(reason, message), message
    for i, out in enumerate(outcomes):
        if i != 3:
            assert isinstance(out, list) and out[0].message.reward == 1.0  # type: ignore[attr-defined]
    metrics = service.metrics()
    assert (metrics["reward/scored"], metrics["reward/failed"], metrics["reward/invalid"]) == (7, 1, 1)


def test_a_list_of_the_wrong_length_is_split_to_the_sample_that_breaks_it(traj: Callable[..., Trajectory]) -> None:
    """A function that drops the answer of one sample answers n-1 values: which one is unknown, so the batch is
    scored one by one and only that sample fails (before, the whole micro-batch failed unsplit)."""
    calls: list[int] = []

    def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict[str, Any]:
        calls.append(len(queries))
        return {"rewards": [1.0 for q in queries if not q.endswith(BAD)]}

    outcomes = _handle_all(_service(reward_func), _batch(traj))
    assert [i for i, o in enumerate(outcomes) if isinstance(o, BaseException)] == [3]
    assert "rewards has 0 values for a batch of 1 samples" in str(outcomes[3])
    assert calls == [8] + [1] * 8


def test_a_sample_answered_nan_once_then_scored_counts_both_calls(traj: Callable[..., Trajectory]) -> None:
    answers = iter([math.nan, 1.0])
    service = _service(lambda queries, prompts, labels: {"rewards": [next(answers)]})

    async def main() -> ScoredTrajectory:
        try:
            with pytest.raises(ScorerError, match="reward is nan"):
                await service.handle(traj(0))  # the consumer loop delivers the entry again
            (out,) = await service.handle(traj(0))
            return out.message  # type: ignore[return-value]
        finally:
            await service.close()

    assert asyncio.run(main()).extra["reward/attempts"] == 2.0


def test_score_mode_scores_the_sample_the_stated_value_counts_and_logs_once_per_n(
    traj: Callable[..., Trajectory], caplog: pytest.LogCaptureFixture
) -> None:
    n = INVALID_LOG_EVERY + 2
    service = _service(_answer(math.nan), on_invalid="score", invalid_value=-1.0)
    with caplog.at_level(logging.WARNING, logger="streamrl.reward.service"):
        outcomes = _handle_all(service, _batch(traj, n=n, bad=tuple(range(1, n))))
    scored = [o[0].message for o in outcomes if isinstance(o, list)]
    assert len(scored) == n and all(isinstance(s, ScoredTrajectory) for s in scored)
    assert scored[0].reward == 1.0
    assert {(s.reward, s.score) for s in scored[1:]} == {(-1.0, -1.0)}
    assert all(math.isfinite(v) for s in scored for v in s.extra.values())
    assert "fn/reward" not in scored[1].extra  # the NaN is not passed on as a metric
    metrics = service.metrics()
    assert (metrics["reward/scored"], metrics["reward/failed"], metrics["reward/invalid"]) == (n, 0, n - 1)
    lines = [r.getMessage() for r in caplog.records if "unusable answer" in r.getMessage()]
    assert len(lines) == 2  # the first and the 101st
    assert lines[0].startswith("reward: 1 samples scored -1 (reward.invalid_value)") and "reward is nan" in lines[0]


def test_parse_marks_the_sample_not_the_call() -> None:
    result = parse_reward_output({"rewards": [1, True, "x"], "extra_logs": {"k": [1, "y", 2]}}, 3, "src")
    assert result.rewards[:2] == [1.0, 1.0] and math.isnan(result.rewards[2])
    assert [result.problem(i) for i in range(3)] == [
        "",
        "extra_logs['k'] is not a number: 'y'",
        "rewards is not a number: 'x'",
    ]
    assert result.extra == [{"k": 1.0}, {}, {"k": 2.0}]
    joined = ScorerResult.concat([result, ScorerResult(rewards=[2.0], scores=[2.0], extra=[{}])])
    assert [joined.problem(i) != "" for i in range(4)] == [False, True, True, False]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"on_invalid": "score"}, "needs invalid_value"),
        ({"invalid_value": 0.0}, 'only with on_invalid = "score"'),
        ({"on_invalid": "score", "invalid_value": math.nan}, "invalid_value"),
        ({"on_invalid": "zero"}, "on_invalid"),
    ],
)
def test_on_invalid_settings_are_checked_at_start(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        _config(**kw)


class TokenModel:
    """A reward model on token ids: reward = the number of ids; fails on an empty sequence as the real one does."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def score_token_ids(self, sequences: list[list[int]]) -> list[float]:
        self.seen.extend(sequences)
        if any(not s for s in sequences):
            raise ValueError("cannot score an empty token sequence")
        return [float(len(s)) for s in sequences]


class HeadsOrWhole:
    """A payload source like Redis: the whole trajectory, or its head (tensors empty)."""

    def __init__(self, trajectories: dict[str, Trajectory]) -> None:
        self.trajectories = trajectories

    async def fetch(self, records: list[TrajectoryRecord], whole: bool) -> list[Trajectory]:
        out = [self.trajectories[r.id] for r in records]
        if whole:
            return out
        empty = Tensor.from_list([], "int32")
        return [msgspec.structs.replace(t, prompt_ids=empty, response_ids=empty) for t in out]


def test_a_token_reading_scorer_passed_in_gets_whole_payloads(traj: Callable[..., Trajectory]) -> None:
    """Before, only the config said whether payloads were read whole: a model scorer on token ids passed in
    directly (its config section another type) was handed heads, with empty tensors."""
    sample = traj(0)
    model = TokenModel()
    scorer = ModelScorer(ModelScorerConfig(name="fn", path="unused", input="token_ids"), model=model)  # type: ignore[arg-type]
    assert scorer.reads_tokens
    service = RewardService(_config(), StreamNames("r"), scorers=[scorer], payloads=HeadsOrWhole({sample.id: sample}))

    async def main() -> list[Output]:
        try:
            return await service.handle(record_of(sample, "k", 100, 10))
        finally:
            await service.close()

    (out,) = asyncio.run(main())
    assert model.seen == [[1, 2, 3, 4, 5]]
    assert out.message.reward == 5.0  # type: ignore[attr-defined]


def test_a_reward_model_answering_nan_fails_that_sample_alone(traj: Callable[..., Trajectory]) -> None:
    """The per-sample check is the service's, for every scorer (a model's NaN too, not only parsed answers)."""

    class NanModel(TokenModel):
        def score_token_ids(self, sequences: list[list[int]]) -> list[float]:
            return [math.nan if i == 1 else 1.0 for i in range(len(sequences))]

    scorer = ModelScorer(ModelScorerConfig(name="fn", path="unused", input="token_ids"), model=NanModel())  # type: ignore[arg-type]
    service = RewardService(_config(), StreamNames("r"), scorers=[scorer])
    outcomes = _handle_all(service, [traj(i) for i in range(4)])
    assert [isinstance(o, ScorerError) for o in outcomes] == [False, True, False, False]
