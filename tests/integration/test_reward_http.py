"""The HTTP scorer against a real reward server process with injected faults (reward_server.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterator

import pytest
from reward_server import ServerProcess

from streamrl.common.messages import ScoredTrajectory, Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.reward.config import HttpScorerConfig, RewardConfig
from streamrl.reward.scorers.base import PermanentScorerError, ScorerError
from streamrl.reward.scorers.http import HttpScorer
from streamrl.reward.service import RewardService

TOKEN = "t0ken-for-tests"

Server = Callable[..., ServerProcess]


@pytest.fixture
def reward_server() -> Iterator[Server]:
    """Start reward_server.py processes (``reward_server(*args, token=...)``); killed at the end."""
    servers: list[ServerProcess] = []

    def start(*args: str, token: str = TOKEN) -> ServerProcess:
        servers.append(ServerProcess(*args, token=token))
        servers[-1].start()
        return servers[-1]

    yield start
    for server in servers:
        server.kill()


def trajectory(i: int) -> Trajectory:
    return Trajectory(
        id=f"g{i}/0",
        group_id=f"g{i}",
        group_index=0,
        group_size=1,
        prompt_ids=Tensor.from_list([1], "int32"),
        response_ids=Tensor.from_list([2], "int32"),
        logprobs=Tensor.from_list([-1.0], "float32"),
        loss_mask=Tensor.from_list([1], "uint8"),
        prompt_text=f"prompt {i}: ",
        response_text="y" * (i % 7),
        label="y" if i % 2 else "z",
    )


def expected_reward(t: Trajectory) -> float:
    return float(len(t.prompt_text + t.response_text))


def http_config(urls: list[str], **overrides: object) -> HttpScorerConfig:
    base: dict[str, object] = {
        "name": "remote",
        "urls": urls,
        "batch_size": 4,
        "max_concurrency": 4,
        "timeout_s": 0.5,
        "max_retries": 4,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "token_env": "RM_TOKEN",
    }
    return HttpScorerConfig(**{**base, **overrides})  # type: ignore[arg-type]


def score_once(scorer: HttpScorer, batch: list[Trajectory]) -> list[float]:
    """Score one batch in a fresh event loop and close the scorer's session."""

    async def main() -> list[float]:
        try:
            return (await scorer.score(batch)).rewards
        finally:
            await scorer.close()

    return asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_trajectory_scored_once_despite_faults(reward_server: Server) -> None:
    server = reward_server("--faults", "500,drop,slow,500,drop,slow", "--slow-s", "3")
    url = server.url
    # A 1 s timeout: a slow answer (3 s) times out, a normal one never does, even on a busy machine.
    scorer = HttpScorer(http_config([url], timeout_s=1.0), env={"RM_TOKEN": TOKEN})
    config = RewardConfig(scorers=[http_config([url])], max_batch_size=8, max_wait_ms=20)
    service = RewardService(config, StreamNames("r"), scorers=[scorer])
    batch = [trajectory(i) for i in range(40)]

    async def main() -> list[ScoredTrajectory]:
        outputs = await asyncio.gather(*(service.handle(t) for t in batch))
        await service.close()
        return [out.message for (out,) in outputs]  # type: ignore[misc]

    scored = asyncio.run(main())
    assert [s.trajectory.id for s in scored] == [t.id for t in batch]
    assert [s.reward for s in scored] == [expected_reward(t) for t in batch]
    assert [s.score for s in scored] == [1.0 if i % 2 and i % 7 else 0.0 for i in range(40)]
    assert all(s.extra["remote/chars"] == expected_reward(s.trajectory) for s in scored)
    metrics = service.metrics()
    # Each injected fault costs exactly one failed attempt, and each is retried.
    assert metrics["reward/http/retries"] == 6
    assert metrics["reward/http/server_errors"] == 2
    assert metrics["reward/http/connection_errors"] == 2
    assert metrics["reward/http/timeouts"] == 2
    assert metrics["reward/http/failures"] == 0
    assert metrics["reward/http/requests"] == metrics["reward/batches"] * 2 + 6  # 8 per batch -> 2 requests
    assert server.stats()["requests"] == metrics["reward/http/requests"]


def test_failover_to_a_live_url(reward_server: Server) -> None:
    dead = f"http://127.0.0.1:{free_port()}/get_reward"
    live = reward_server().url
    scorer = HttpScorer(http_config([dead, live], load_balancing="round_robin"), env={"RM_TOKEN": TOKEN})
    batch = [trajectory(i) for i in range(32)]

    async def main() -> list[float]:
        results = await asyncio.gather(*(scorer.score(batch[i : i + 4]) for i in range(0, 32, 4)))
        await scorer.close()
        return [r for res in results for r in res.rewards]

    assert asyncio.run(main()) == [expected_reward(t) for t in batch]
    metrics = scorer.metrics()
    assert metrics["reward/http/failures"] == 0
    # The dead URL is tried, then avoided while it is cooling down: far fewer errors than requests.
    assert 1 <= metrics["reward/http/connection_errors"] <= 4
    assert metrics["reward/http/retries"] == metrics["reward/http/connection_errors"]


def test_permanent_failure_raises_with_the_reason(reward_server: Server) -> None:
    server = reward_server("--always", "500")
    url = server.url
    scorer = HttpScorer(http_config([url], max_retries=2), env={"RM_TOKEN": TOKEN})
    with pytest.raises(
        ScorerError,
        match=r"not scored after 3 attempts .*last error: .*HTTP 500: injected internal error",
    ) as failed:
        score_once(scorer, [trajectory(i) for i in range(6)])  # 2 requests
    assert not isinstance(failed.value, PermanentScorerError)  # a 500 may be the samples' doing: retried, dead-lettered
    metrics = scorer.metrics()
    assert metrics["reward/http/failures"] >= 1
    assert metrics["reward/http/retries"] >= 2


def test_unreachable_service_raises(reward_server: Server) -> None:
    scorer = HttpScorer(
        http_config([f"http://127.0.0.1:{free_port()}/get_reward"], max_retries=1),
        env={"RM_TOKEN": TOKEN},
    )
    with pytest.raises(
        PermanentScorerError, match=r"not scored after 2 attempts .*connection refused \(is the service up\?\)"
    ):  # down, whatever the samples: the reward service pauses
        score_once(scorer, [trajectory(0)])


def test_a_refused_token_fails_at_once_naming_its_variable(reward_server: Server) -> None:
    """401/403 are never retried and say which environment variable holds the token (before: "HTTP 401
    (not retried)" with the server's body, nothing pointing at the token's variable)."""
    server = reward_server()
    url = server.url
    scorer = HttpScorer(http_config([url]), env={"RM_TOKEN": "wrong"})
    with pytest.raises(
        PermanentScorerError,
        match=r"HTTP 403, not retried: the server refused the token in \$RM_TOKEN \(token_env\)",
    ) as refused:
        score_once(scorer, [trajectory(0)])
    assert refused.value.attempts == 1 and not refused.value.sample_specific
    assert scorer.metrics()["reward/http/requests"] == 1
    assert scorer.metrics()["reward/http/retries"] == 0
    assert server.stats().get("forbidden") == 1
    anonymous = HttpScorer(http_config([url], token_env=None))
    with pytest.raises(PermanentScorerError, match=r"HTTP 401, not retried: the server wants a token: set token_env"):
        score_once(anonymous, [trajectory(0)])
    assert server.stats().get("unauthorized") == 1


def test_other_client_errors_are_not_retried(reward_server: Server) -> None:
    server = reward_server()
    url = server.url
    scorer = HttpScorer(http_config([url.replace("/get_reward", "/nowhere")]), env={"RM_TOKEN": TOKEN})
    with pytest.raises(ScorerError, match=r"HTTP 404, not retried: 404: Not Found"):
        score_once(scorer, [trajectory(0)])
    assert scorer.metrics()["reward/http/retries"] == 0


def test_a_server_failing_for_a_while_is_ridden_out_with_one_log_line_each_way(
    reward_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """500s for 1 s: every request retries with jittered backoff until the server answers; the result
    says how many attempts each sample took; one WARNING when the URL starts failing and one INFO when
    it answers again (before: a WARNING per failed attempt, and no attempt counts)."""
    server = reward_server()
    url = server.url
    server.control("500", for_s=1.0)
    config = http_config([url], max_retries=100, retry_timeout_s=10, backoff_base_s=0.05, backoff_max_s=0.3)
    scorer = HttpScorer(config, env={"RM_TOKEN": TOKEN})
    batch = [trajectory(i) for i in range(16)]  # 4 requests

    async def main() -> list[int]:
        try:
            return (await scorer.score(batch)).attempts or []
        finally:
            await scorer.close()

    with caplog.at_level(logging.DEBUG, logger="streamrl.reward.scorers.http"):
        attempts = asyncio.run(main())
    assert len(attempts) == 16 and min(attempts) >= 2
    assert sum(attempts[::4]) == scorer.metrics()["reward/http/requests"] == server.stats()["requests"]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 2, lines
    assert lines[0][0] == logging.WARNING and f"{url} is failing: HTTP 500: injected internal error" in lines[0][1]
    assert lines[1][0] == logging.INFO and f"{url} answers again after" in lines[1][1]


def test_retries_stop_at_the_retry_timeout_with_a_one_line_reason(reward_server: Server) -> None:
    """A server failing for longer than retry_timeout_s: the request gives up then (not after
    max_retries), with one line naming the attempts, the time, the URL and the flattened body."""
    server = reward_server("--always", "500")
    url = server.url
    config = http_config([url], max_retries=1000, retry_timeout_s=0.5, backoff_base_s=0.05, backoff_max_s=0.1)
    scorer = HttpScorer(config, env={"RM_TOKEN": TOKEN})
    with pytest.raises(ScorerError) as failed:
        score_once(scorer, [trajectory(0)])
    message = str(failed.value)
    assert failed.value.attempts >= 3 and scorer.metrics()["reward/http/requests"] == failed.value.attempts
    assert f"not scored after {failed.value.attempts} attempts in 0." in message
    assert message.endswith(
        f"to {url}; last error: HTTP 500: injected internal error Traceback (most recent call last): ..."
    )
    assert "\n" not in message


@pytest.mark.parametrize("fault", ["drop", "down"])
def test_connection_faults_read_as_one_short_line(reward_server: Server, fault: str) -> None:
    url = reward_server("--always", "drop").url if fault == "drop" else f"http://127.0.0.1:{free_port()}/get_reward"
    scorer = HttpScorer(http_config([url], max_retries=1), env={"RM_TOKEN": TOKEN})
    with pytest.raises(ScorerError) as failed:
        score_once(scorer, [trajectory(0)])
    expected = {
        "drop": "the server closed the connection without answering",
        "down": "connection refused (is the service up?)",
    }[fault]
    assert str(failed.value).endswith(f"last error: {expected}")


def test_wrong_length_answer_is_an_error_not_zero(reward_server: Server) -> None:
    server = reward_server("--always", "short")
    url = server.url
    scorer = HttpScorer(http_config([url]), env={"RM_TOKEN": TOKEN})
    with pytest.raises(ScorerError, match="rewards has 2 values for a batch of 3 samples"):
        score_once(scorer, [trajectory(i) for i in range(3)])
    assert scorer.metrics()["reward/http/bad_responses"] == 1
