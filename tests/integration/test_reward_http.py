"""The HTTP scorer against a real reward server process with injected faults (reward_server.py)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from streamrl.common.messages import ScoredTrajectory, Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.reward.config import HttpScorerConfig, RewardConfig
from streamrl.reward.scorers.base import ScorerError
from streamrl.reward.scorers.http import HttpScorer
from streamrl.reward.service import RewardService

SERVER = Path(__file__).with_name("reward_server.py")
TOKEN = "t0ken-for-tests"

Server = Callable[..., str]


@pytest.fixture
def reward_server() -> Iterator[Server]:
    """Start reward_server.py processes; returns the /get_reward URL of each."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, token: str = TOKEN) -> str:
        env = {**os.environ, "REWARD_SERVER_TOKEN": token, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, str(SERVER), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), f"reward server did not start: {line!r}"
        return f"http://127.0.0.1:{int(line.split()[-1])}/get_reward"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def server_stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url.replace("/get_reward", "/stats"), timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


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
    url = reward_server("--faults", "500,drop,slow,500,drop,slow", "--slow-s", "3")
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
    assert server_stats(url)["requests"] == metrics["reward/http/requests"]


def test_failover_to_a_live_url(reward_server: Server) -> None:
    dead = f"http://127.0.0.1:{free_port()}/get_reward"
    live = reward_server()
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
    url = reward_server("--always", "500")
    scorer = HttpScorer(http_config([url], max_retries=2), env={"RM_TOKEN": TOKEN})
    with pytest.raises(
        ScorerError,
        match=r"not scored after 3 attempts .*last error: .*HTTP 500: injected internal error",
    ):
        score_once(scorer, [trajectory(i) for i in range(6)])  # 2 requests
    metrics = scorer.metrics()
    assert metrics["reward/http/failures"] >= 1
    assert metrics["reward/http/retries"] >= 2


def test_unreachable_service_raises(reward_server: Server) -> None:
    scorer = HttpScorer(
        http_config([f"http://127.0.0.1:{free_port()}/get_reward"], max_retries=1),
        env={"RM_TOKEN": TOKEN},
    )
    with pytest.raises(ScorerError, match=r"not scored after 2 attempts .*ClientConnectorError"):
        score_once(scorer, [trajectory(0)])


def test_client_errors_are_not_retried(reward_server: Server) -> None:
    url = reward_server()
    scorer = HttpScorer(http_config([url]), env={"RM_TOKEN": "wrong"})
    with pytest.raises(ScorerError, match=r"HTTP 401 \(not retried\)"):
        score_once(scorer, [trajectory(0)])
    assert scorer.metrics()["reward/http/requests"] == 1
    assert scorer.metrics()["reward/http/retries"] == 0
    assert server_stats(url).get("unauthorized") == 1


def test_wrong_length_answer_is_an_error_not_zero(reward_server: Server) -> None:
    url = reward_server("--always", "short")
    scorer = HttpScorer(http_config([url]), env={"RM_TOKEN": TOKEN})
    with pytest.raises(ScorerError, match="rewards has 2 values for a batch of 3 samples"):
        score_once(scorer, [trajectory(i) for i in range(3)])
    assert scorer.metrics()["reward/http/bad_responses"] == 1
