"""Scorer calling remote reward services over HTTP (the OpenRLHF JSON protocol).

``POST {"query": [...], "prompts": [...], "labels": [...]}`` -> ``{"rewards", "scores", "extra_logs"}``.

* A micro-batch is cut into requests of at most ``batch_size`` samples, sent concurrently
  (at most ``max_concurrency`` in flight over all URLs).
* Each request has a total timeout. Timeouts, connection errors, HTTP 5xx, 408 and 429 are
  retried with capped exponential backoff and jitter (so the requests of a failed batch do not
  retry in lockstep), up to ``max_retries`` times and no later than ``retry_timeout_s`` after
  the first attempt: a service that fails or is down for less than that is ridden out. When not one attempt
  could even connect (the service is down, not failing on these samples) the request fails with
  ``PermanentScorerError`` (the reward service pauses, :mod:`streamrl.reward.pause`); a 5xx, a timeout or a
  dropped connection may be caused by the samples, so those fail with ``ScorerError`` (retried, dead-lettered).
  401 and 403 are never retried: ``PermanentScorerError`` naming the environment variable that holds the
  token that was refused. Other 4xx answers and malformed bodies (no rewards, wrong length, not numbers)
  fail at once.
* Several URLs: each attempt picks one by round-robin or least-loaded; a URL that just failed
  is avoided for a while and a retry prefers a URL the request has not tried (fail-over).
* When every attempt failed, ``ScorerError`` says how often, for how long, where and the last
  reason, on one line (server bodies and client errors are flattened and cut).
* An answer body is read up to ``max_response_mb``: a larger one fails the request (not retried; its
  samples are scored one by one) naming that limit. Redirects are not followed: a 3xx answer fails
  (not retried) naming where it pointed (``Location``), so a token never goes to an address not in ``urls``.
* A URL's password (``http://user:password@host``) is sent, never shown: every log line, error,
  dead letter and span names the URL with ``***`` in its place (:func:`streamrl.common.redact.redact_url`).
* Logging: one WARNING line when a URL starts failing and one INFO line when it answers again,
  however many requests meet the fault; each failed attempt is logged at DEBUG.

Counters (``metrics()``): ``reward/http/{requests,retries,failures,timeouts,connection_errors,
server_errors,client_errors,bad_responses}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from streamrl.common.messages import Trajectory
from streamrl.common.redact import redact_url
from streamrl.reward.config import HttpScorerConfig
from streamrl.reward.scorers.base import (
    PermanentScorerError,
    ScorerError,
    ScorerResult,
    parse_reward_output,
    protocol_inputs,
)

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429})
"""4xx answers that mean "try again later"; every 5xx is retried too."""
AUTH_STATUS = frozenset({401, 403})
"""The server refused the token (or its absence): never retried, the reason names ``token_env``."""
SAMPLE_SPECIFIC_STATUS = frozenset({400, 413, 422})
"""4xx answers that may be caused by particular samples (malformed, too large)."""
MAX_ERROR_BODY_CHARS = 200
FAILED_URL_COOLDOWN_S = 2.0
"""After a failed attempt a URL is used only when no other URL is left, for this long."""


def one_line(text: str, limit: int = MAX_ERROR_BODY_CHARS) -> str:
    """``text`` with every run of whitespace (newlines included) made one space, URL passwords masked,
    cut to ``limit`` chars."""
    flat = redact_url(" ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def describe_client_error(error: aiohttp.ClientError) -> str:
    """A short phrase for a failed connection or exchange (aiohttp's own text holds reprs)."""
    if isinstance(error, aiohttp.ClientConnectorError):
        cause = error.os_error
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused (is the service up?)"
        return f"cannot connect: {one_line(cause.strerror or type(cause).__name__)}"
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without answering"
    if isinstance(error, aiohttp.ClientPayloadError):
        return "the answer was cut off"
    if isinstance(error, aiohttp.ClientOSError):
        return f"connection error: {one_line(error.strerror or type(error).__name__)}"
    return one_line(f"{type(error).__name__}: {error}")


class _Unreachable(str):
    """The reason of an attempt that could not connect: no sample can be the cause."""


def backoff_delay_s(retry: int, base_s: float, max_s: float, jitter: float, rng: random.Random) -> float:
    """Delay before retry ``retry`` (0-based): ``min(max_s, base_s * 2**retry)``, of which a
    ``jitter`` fraction is drawn uniformly at random (1.0 = full jitter)."""
    cap = min(max_s, base_s * 2.0**retry)
    return cap * (1.0 - jitter * rng.random())


def next_retry_delay_s(
    config: HttpScorerConfig, retries_done: int, elapsed_s: float, rng: random.Random
) -> float | None:
    """Backoff before the next retry of a request whose first attempt was ``elapsed_s`` ago, or None
    when it gives up: ``max_retries`` done, or the retry would start past ``retry_timeout_s``."""
    if retries_done >= config.max_retries:
        return None
    delay_s = backoff_delay_s(retries_done, config.backoff_base_s, config.backoff_max_s, config.jitter, rng)
    return None if elapsed_s + delay_s > config.retry_timeout_s else delay_s


async def read_body(resp: aiohttp.ClientResponse, max_bytes: int) -> str | None:
    """The answer's body as text, or None when it is longer than ``max_bytes`` (the rest is not read)."""
    if resp.content_length is not None and resp.content_length > max_bytes:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks).decode(resp.charset or "utf-8", errors="replace")


@dataclass
class _Endpoint:
    url: str
    """Where requests go, with its password if it has one: never shown (``shown`` is)."""
    in_flight: int = 0
    avoid_until: float = 0.0
    """Monotonic time until which this URL is only used when no other is available."""
    failing_since: float | None = None
    """Monotonic time of the first failed attempt since the URL last answered; None = healthy."""
    failed_attempts: int = 0
    """Failed attempts since ``failing_since``."""

    @property
    def shown(self) -> str:
        """The URL as logs and errors show it: its password masked."""
        return redact_url(self.url)

    def failed(self, reason: str, scorer: str, what_next: str, level: int = logging.WARNING) -> None:
        """Note a failed attempt; the first one of an outage logs one line (at ``level``)."""
        now = time.monotonic()
        self.avoid_until = now + FAILED_URL_COOLDOWN_S
        self.failed_attempts += 1
        if self.failing_since is None:
            self.failing_since = now
            logger.log(
                level,
                "reward http scorer %s: %s is failing: %s (%s)",
                scorer,
                self.shown,
                reason,
                what_next,
            )
        else:
            logger.debug("reward http scorer %s: %s failed again: %s", scorer, self.shown, reason)

    def answered(self, scorer: str) -> None:
        """Note an answer; the first after an outage logs one INFO line."""
        self.avoid_until = 0.0
        if self.failing_since is not None:
            logger.info(
                "reward http scorer %s: %s answers again after %.1f s (%d failed attempts)",
                scorer,
                self.shown,
                time.monotonic() - self.failing_since,
                self.failed_attempts,
            )
            self.failing_since, self.failed_attempts = None, 0


class EndpointPool:
    """Picks a URL per attempt: round-robin or least-loaded, skipping recently failed ones."""

    def __init__(self, urls: list[str], policy: str) -> None:
        self.endpoints = [_Endpoint(u) for u in urls]
        self._policy = policy
        self._next = 0

    def pick(self, tried: set[str]) -> _Endpoint:
        now = time.monotonic()
        # Prefer healthy URLs this request has not tried; then untried; then any.
        for keep in (
            lambda e: e.url not in tried and e.avoid_until <= now,
            lambda e: e.url not in tried,
            lambda e: True,
        ):
            candidates = [e for e in self._in_rotation_order() if keep(e)]
            if candidates:
                break
        if self._policy == "least_loaded":
            chosen = min(candidates, key=lambda e: e.in_flight)  # min keeps rotation order on ties
        else:
            chosen = candidates[0]
        self._next = (self.endpoints.index(chosen) + 1) % len(self.endpoints)
        return chosen

    def _in_rotation_order(self) -> list[_Endpoint]:
        return self.endpoints[self._next :] + self.endpoints[: self._next]


def _auth_headers(config: HttpScorerConfig, env: Mapping[str, str]) -> dict[str, str]:
    if config.token_env is None:
        return {}
    token = env.get(config.token_env, "")
    if not token:
        raise ValueError(f"http scorer {config.name!r}: environment variable {config.token_env} (token_env) is not set")
    return {config.auth_header: f"{config.auth_scheme} {token}" if config.auth_scheme else token}


class HttpScorer:
    """Scores micro-batches with one or more remote reward services."""

    reads_tokens = False

    def __init__(
        self,
        config: HttpScorerConfig,
        env: Mapping[str, str] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.name = config.name
        self._config = config
        self._headers = _auth_headers(config, os.environ if env is None else env)
        self._pool = EndpointPool(list(config.urls), config.load_balancing)
        self._rng = rng or random.Random()
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._counts: Counter[str] = Counter()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._config.max_concurrency)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def score(self, batch: list[Trajectory]) -> ScorerResult:
        inputs = protocol_inputs(batch)
        size = self._config.batch_size
        tasks = [
            asyncio.ensure_future(
                self._post(
                    {
                        "query": inputs.queries[i : i + size],
                        "prompts": inputs.prompts[i : i + size],
                        "labels": inputs.labels[i : i + size],
                    },
                    n=len(inputs.queries[i : i + size]),
                )
            )
            for i in range(0, len(batch), size)
        ]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one chunk failed: the batch fails, stop the others
                task.cancel()
            raise
        return ScorerResult.concat(parts)

    async def _post(self, payload: dict[str, Any], n: int) -> ScorerResult:
        """One request with retries and fail-over; raises ScorerError when it cannot succeed."""
        cfg = self._config
        started = time.monotonic()
        tried: set[str] = set()
        shown: set[str] = set()
        reason = ""
        attempts = 0
        answered = False  # an endpoint answered (an HTTP error): the backend is there, its failure is not permanent
        while True:
            if attempts:
                delay_s = next_retry_delay_s(cfg, attempts - 1, time.monotonic() - started, self._rng)
                if delay_s is None:
                    break
                self._counts["retries"] += 1
                await asyncio.sleep(delay_s)
            attempts += 1
            async with self._slots:
                endpoint = self._pool.pick(tried)
                tried.add(endpoint.url)
                shown.add(endpoint.shown)
                endpoint.in_flight += 1
                try:
                    outcome = await self._attempt(endpoint, payload, n)
                except ScorerError as e:
                    e.attempts = attempts
                    raise
                finally:
                    endpoint.in_flight -= 1
            if isinstance(outcome, ScorerResult):
                return dataclasses.replace(outcome, attempts=[attempts] * n, retries=attempts - 1)
            reason = outcome
            answered = answered or not isinstance(outcome, _Unreachable)
        self._counts["failures"] += 1
        error = ScorerError if answered else PermanentScorerError  # not one attempt could connect: permanent
        raise error(
            f"http scorer {self.name!r}: {n} samples not scored after {attempts} attempts in "
            f"{time.monotonic() - started:.1f} s to {', '.join(sorted(shown))}; last error: {reason}",
            attempts=attempts,
        )

    async def _attempt(self, endpoint: _Endpoint, payload: dict[str, Any], n: int) -> ScorerResult | str:
        """One POST: the result, or the reason of a retryable failure; raises ScorerError otherwise."""
        self._counts["requests"] += 1
        source = f"http scorer {self.name!r} ({endpoint.shown})"
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_s)
        max_bytes = int(self._config.max_response_mb * 2**20)
        try:
            async with self._get_session().post(
                endpoint.url, json=payload, timeout=timeout, allow_redirects=False
            ) as resp:
                status, location = resp.status, resp.headers.get("Location", "")
                body = await read_body(resp, max_bytes)
        except TimeoutError:
            self._counts["timeouts"] += 1
            return self._retryable(endpoint, f"no answer within {self._config.timeout_s} s")
        except aiohttp.ClientError as e:
            self._counts["connection_errors"] += 1
            reason = self._retryable(endpoint, describe_client_error(e))
            return _Unreachable(reason) if isinstance(e, aiohttp.ClientConnectorError) else reason
        too_long = f"answer over {self._config.max_response_mb:g} MiB (max_response_mb), not read"
        body_text = too_long if body is None else body
        if 300 <= status < 400:  # a token is never sent on to an address not in urls
            self._counts["client_errors"] += 1
            detail = (
                f"HTTP {status} redirect to {one_line(location) or '(no Location)'}, not followed: "
                "set urls to the address that answers"
            )
            endpoint.failed(detail, self.name, "entries fail until this is fixed", logging.ERROR)
            raise ScorerError(f"{source}: {detail}")
        if status >= 500 or status in RETRYABLE_STATUS:
            self._counts["server_errors"] += 1
            return self._retryable(endpoint, f"HTTP {status}: {one_line(body_text)}")
        if status >= 400:
            self._counts["client_errors"] += 1
            detail = self._client_error(status, one_line(body_text))
            if status in AUTH_STATUS:
                endpoint.failed(detail, self.name, "scoring pauses until the token is accepted", logging.ERROR)
                raise PermanentScorerError(f"{source}: {detail}")
            endpoint.failed(detail, self.name, "entries fail until this is fixed", logging.ERROR)
            raise ScorerError(f"{source}: {detail}", sample_specific=status in SAMPLE_SPECIFIC_STATUS)
        endpoint.answered(self.name)
        if body is None:  # fewer samples make a shorter answer: they are scored one by one
            self._counts["bad_responses"] += 1
            raise ScorerError(f"{source}: {too_long}", sample_specific=True)
        try:
            data = json.loads(body_text)
        except json.JSONDecodeError as e:
            self._counts["bad_responses"] += 1
            raise ScorerError(f"{source}: answer is not JSON ({e}): {one_line(body_text)!r}") from e
        try:
            return parse_reward_output(data, n, source)
        except ScorerError:
            self._counts["bad_responses"] += 1
            raise

    def _retryable(self, endpoint: _Endpoint, reason: str) -> str:
        what_next = f"requests retry with backoff for up to {self._config.retry_timeout_s:.0f} s each"
        endpoint.failed(reason, self.name, what_next)
        return reason

    def _client_error(self, status: int, body: str) -> str:
        """What a 4xx answer that is not retried means; 401/403 name the token's variable."""
        if status not in AUTH_STATUS:
            return f"HTTP {status}, not retried: {body}"
        env = self._config.token_env
        if env is None:
            hint = "the server wants a token: set token_env to the environment variable that holds it"
        else:
            hint = (
                f"the server refused the token in ${env} (token_env): give the server the token the reward service "
                f"holds (scoring resumes by itself), or restart the service with the right one in ${env}"
            )
        return f"HTTP {status}, not retried: {hint}; server said: {body}"

    def metrics(self) -> dict[str, float]:
        keys = (
            "requests",
            "retries",
            "failures",
            "timeouts",
            "connection_errors",
            "server_errors",
            "client_errors",
            "bad_responses",
        )
        return {f"reward/http/{k}": float(self._counts[k]) for k in keys}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
