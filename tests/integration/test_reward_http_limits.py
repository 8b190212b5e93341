"""The HTTP scorer's limits against a real aiohttp server in the test's loop: answers over ``max_response_mb``
fail naming the limit, redirects are not followed (the error names the Location, masked), and a password in a
URL is sent as basic auth but shown nowhere (errors, log lines)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from streamrl.common.messages import Tensor, Trajectory
from streamrl.reward.config import HttpScorerConfig
from streamrl.reward.scorers.base import ScorerError, ScorerResult
from streamrl.reward.scorers.http import HttpScorer

PASSWORD = "s3cret-pw-in-url"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def trajectory(i: int) -> Trajectory:
    empty = Tensor.from_list([], "int32")
    return Trajectory(
        id=f"g{i}/0",
        group_id=f"g{i}",
        group_index=0,
        group_size=1,
        prompt_ids=empty,
        response_ids=empty,
        logprobs=Tensor.from_list([], "float32"),
        loss_mask=Tensor.from_list([], "uint8"),
        prompt_text="p",
        response_text=f"r{i}",
    )


def _score(handlers: dict[str, Handler], url_of: Callable[[int], list[str]], **config: Any) -> ScorerResult:
    """Serve ``handlers`` (path -> handler) on a free port, score two samples with an HTTP scorer on
    ``url_of(port)``; the scorer's error is raised."""

    async def main() -> ScorerResult:
        app = web.Application()
        for path, handler in handlers.items():
            app.router.add_post(path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        base = {"name": "remote", "max_retries": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.01, "timeout_s": 5}
        scorer = HttpScorer(HttpScorerConfig(**{**base, "urls": url_of(port), **config}))
        try:
            return await scorer.score([trajectory(0), trajectory(1)])
        finally:
            await scorer.close()
            await runner.cleanup()

    return asyncio.run(main())


async def _ok(request: web.Request) -> web.Response:
    n = len((await request.json())["query"])
    return web.json_response({"rewards": [1.0] * n})


def _huge(chunked: bool) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        n = len((await request.json())["query"])
        body = json.dumps({"rewards": [1.0] * n, "extra_logs": {"pad": ["x" * 1000] * 3000}}).encode()
        if not chunked:
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for start in range(0, len(body), 65536):
            await resp.write(body[start : start + 65536])
        await resp.write_eof()
        return resp

    return handler


@pytest.mark.parametrize("chunked", [False, True])
def test_an_answer_over_max_response_mb_fails_naming_the_limit(chunked: bool) -> None:
    """Before, the whole body was read however large (resp.text())."""
    with pytest.raises(ScorerError) as failed:
        _score({"/score": _huge(chunked)}, lambda p: [f"http://127.0.0.1:{p}/score"], max_response_mb=1)
    assert "answer over 1 MiB (max_response_mb), not read" in str(failed.value)
    assert failed.value.sample_specific  # fewer samples, a shorter answer: the batcher scores them one by one
    assert failed.value.attempts == 1  # not retried


def test_an_answer_under_the_limit_is_read() -> None:
    assert _score({"/score": _ok}, lambda p: [f"http://127.0.0.1:{p}/score"], max_response_mb=1).rewards == [1.0, 1.0]


def test_a_redirect_is_not_followed_and_its_location_is_shown_masked(caplog: pytest.LogCaptureFixture) -> None:
    """Before, aiohttp followed it (with the token) to wherever it pointed."""
    followed: list[str] = []

    async def moved(request: web.Request) -> web.Response:
        port = request.url.port
        raise web.HTTPFound(f"http://admin:{PASSWORD}@127.0.0.1:{port}/elsewhere")

    async def elsewhere(request: web.Request) -> web.Response:
        followed.append(request.path)
        return await _ok(request)

    with caplog.at_level(logging.DEBUG), pytest.raises(ScorerError) as failed:
        _score({"/score": moved, "/elsewhere": elsewhere}, lambda p: [f"http://127.0.0.1:{p}/score"])
    message = str(failed.value)
    assert "HTTP 302 redirect to http://admin:***@127.0.0.1:" in message and "not followed" in message
    assert not followed and failed.value.attempts == 1
    assert PASSWORD not in message and PASSWORD not in caplog.text


def test_a_password_in_a_url_is_sent_but_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    async def failing(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        raise web.HTTPInternalServerError(text=f"cannot reach http://admin:{PASSWORD}@db:5432/x")

    with caplog.at_level(logging.DEBUG), pytest.raises(ScorerError) as failed:
        _score({"/score": failing}, lambda p: [f"http://admin:{PASSWORD}@127.0.0.1:{p}/score"])
    assert seen and seen[0] == "Basic " + base64.b64encode(f"admin:{PASSWORD}".encode()).decode()
    message = str(failed.value)
    assert "http://admin:***@127.0.0.1:" in message and "http://admin:***@db:5432/x" in message
    assert PASSWORD not in message
    assert "admin:***@127.0.0.1" in caplog.text and PASSWORD not in caplog.text


def test_a_password_in_a_url_and_a_token_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"'http://u:\*\*\*@h/x' carries a password and token_env is set") as e:
        HttpScorerConfig(name="r", urls=[f"http://u:{PASSWORD}@h/x"], token_env="T")
    assert PASSWORD not in str(e.value).split("input_value")[0]
