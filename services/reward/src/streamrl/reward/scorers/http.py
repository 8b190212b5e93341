"""Scorer calling remote reward services over HTTP (the OpenRLHF JSON protocol).

``POST {"query": [...], "prompts": [...], "labels": [...]}`` -> ``{"rewards", "scores", "extra_logs"}``.

* A micro-batch is cut into requests of at most ``batch_size`` samples, sent concurrently
  (at most ``max_concurrency`` in flight over all URLs).
* Each request has a total timeout. Timeouts, connection errors, HTTP 5xx, 408 and 429 are
  retried up to ``max_retries`` times with exponential backoff and jitter; other 4xx answers and
  malformed bodies (no rewards, wrong length, not numbers) fail at once.
* Several URLs: each attempt picks one by round-robin or least-loaded; a URL that just failed
  is avoided for a while and a retry prefers a URL the request has not tried (fail-over).
* When every attempt failed, ``ScorerError`` says how often, where and the last reason.

Counters (``metrics()``): ``reward/http/{requests,retries,failures,timeouts,connection_errors,
server_errors,client_errors,bad_responses}``.
"""

from __future__ import annotations

import asyncio
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
from streamrl.reward.config import HttpScorerConfig
from streamrl.reward.scorers.base import (
    ScorerError,
    ScorerResult,
    parse_reward_output,
    protocol_inputs,
)

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429})
"""4xx answers that mean "try again later"; every 5xx is retried too."""
SAMPLE_SPECIFIC_STATUS = frozenset({400, 413, 422})
"""4xx answers that may be caused by particular samples (malformed, too large)."""
MAX_ERROR_BODY_CHARS = 300
FAILED_URL_COOLDOWN_S = 2.0
"""After a failed attempt a URL is used only when no other URL is left, for this long."""


def backoff_delay_s(retry: int, base_s: float, max_s: float, jitter: float, rng: random.Random) -> float:
    """Delay before retry ``retry`` (0-based): ``min(max_s, base_s * 2**retry)``, of which a
    ``jitter`` fraction is drawn uniformly at random (1.0 = full jitter)."""
    cap = min(max_s, base_s * 2.0**retry)
    return cap * (1.0 - jitter * rng.random())


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0
    avoid_until: float = 0.0
    """Monotonic time until which this URL is only used when no other is available."""


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
        tried: set[str] = set()
        reasons: list[str] = []
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self._counts["retries"] += 1
                await asyncio.sleep(
                    backoff_delay_s(
                        attempt - 1,
                        cfg.backoff_base_s,
                        cfg.backoff_max_s,
                        cfg.jitter,
                        self._rng,
                    )
                )
            async with self._slots:
                endpoint = self._pool.pick(tried)
                tried.add(endpoint.url)
                endpoint.in_flight += 1
                try:
                    outcome = await self._attempt(endpoint.url, payload, n)
                finally:
                    endpoint.in_flight -= 1
            if isinstance(outcome, ScorerResult):
                endpoint.avoid_until = 0.0
                return outcome
            endpoint.avoid_until = time.monotonic() + FAILED_URL_COOLDOWN_S
            reasons.append(outcome)
            logger.warning(
                "reward http scorer %s: attempt %d/%d failed: %s",
                self.name,
                attempt + 1,
                cfg.max_retries + 1,
                outcome,
            )
        self._counts["failures"] += 1
        raise ScorerError(
            f"http scorer {self.name!r}: {n} samples not scored after {cfg.max_retries + 1} attempts "
            f"to {sorted(tried)}; last error: {reasons[-1]}",
        )

    async def _attempt(self, url: str, payload: dict[str, Any], n: int) -> ScorerResult | str:
        """One POST: the result, or the reason of a retryable failure; raises ScorerError otherwise."""
        self._counts["requests"] += 1
        source = f"http scorer {self.name!r} ({url})"
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_s)
        try:
            async with self._get_session().post(url, json=payload, timeout=timeout) as resp:
                if resp.status >= 500 or resp.status in RETRYABLE_STATUS:
                    self._counts["server_errors"] += 1
                    return f"{url}: HTTP {resp.status}: {(await resp.text())[:MAX_ERROR_BODY_CHARS]}"
                if resp.status >= 400:
                    self._counts["client_errors"] += 1
                    body = (await resp.text())[:MAX_ERROR_BODY_CHARS]
                    raise ScorerError(
                        f"{source}: HTTP {resp.status} (not retried): {body}",
                        sample_specific=resp.status in SAMPLE_SPECIFIC_STATUS,
                    )
                body_text = await resp.text()
        except TimeoutError:
            self._counts["timeouts"] += 1
            return f"{url}: no answer within {self._config.timeout_s} s"
        except aiohttp.ClientError as e:
            self._counts["connection_errors"] += 1
            return f"{url}: {type(e).__name__}: {e}"
        try:
            data = json.loads(body_text)
        except json.JSONDecodeError as e:
            self._counts["bad_responses"] += 1
            raise ScorerError(f"{source}: answer is not JSON ({e}): {body_text[:MAX_ERROR_BODY_CHARS]!r}") from e
        try:
            return parse_reward_output(data, n, source)
        except ScorerError:
            self._counts["bad_responses"] += 1
            raise

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
