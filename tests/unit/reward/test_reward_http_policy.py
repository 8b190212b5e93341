"""Pure parts of the HTTP scorer: backoff with jitter, URL choice, auth header from the environment."""

from __future__ import annotations

import random

import pytest

from streamrl.reward.config import HttpScorerConfig
from streamrl.reward.scorers.http import EndpointPool, HttpScorer, backoff_delay_s, next_retry_delay_s, one_line


def test_backoff_doubles_caps_and_jitters() -> None:
    rng = random.Random(0)
    assert [backoff_delay_s(k, 0.5, 3.0, 0.0, rng) for k in range(5)] == [
        0.5,
        1.0,
        2.0,
        3.0,
        3.0,
    ]
    full = [backoff_delay_s(2, 0.5, 3.0, 1.0, rng) for _ in range(200)]
    assert all(0.0 <= d <= 2.0 for d in full) and max(full) - min(full) > 1.0
    half = [backoff_delay_s(0, 1.0, 3.0, 0.5, rng) for _ in range(200)]
    assert all(0.5 <= d <= 1.0 for d in half)


def retry_span_s(config: HttpScorerConfig, rng: random.Random) -> float:
    """When a request against a service that refuses at once makes its last attempt (s after the first)."""
    elapsed_s, retries = 0.0, 0
    while (delay_s := next_retry_delay_s(config, retries, elapsed_s, rng)) is not None:
        elapsed_s, retries = elapsed_s + delay_s, retries + 1
    return elapsed_s


def test_default_retries_ride_out_a_30_s_outage() -> None:
    """With the default policy a request keeps retrying for 30 s and more (the finding: a remote service
    down for 30 s). Before: 3 retries of at most 0.5 + 1 + 2 s, given up after ~1.8 s on average."""
    config = HttpScorerConfig(name="h", urls=["http://x/"])
    rng = random.Random(0)
    spans = [retry_span_s(config, rng) for _ in range(1000)]
    assert min(spans) >= 30.0 and max(spans) <= config.retry_timeout_s


def test_retries_stop_at_max_retries_or_retry_timeout() -> None:
    rng = random.Random(0)
    few = HttpScorerConfig(name="h", urls=["http://x/"], max_retries=2, jitter=0.0, backoff_base_s=1.0)
    assert [next_retry_delay_s(few, k, 0.0, rng) for k in range(3)] == [1.0, 2.0, None]
    short = HttpScorerConfig(name="h", urls=["http://x/"], retry_timeout_s=5.0, jitter=0.0, backoff_base_s=1.0)
    assert next_retry_delay_s(short, 2, 1.0, rng) == 4.0  # starts at 5.0 s: still inside
    assert next_retry_delay_s(short, 2, 1.5, rng) is None  # would start at 5.5 s


def test_round_robin_and_failover() -> None:
    pool = EndpointPool(["a", "b", "c"], "round_robin")
    assert [pool.pick(set()).url for _ in range(4)] == ["a", "b", "c", "a"]
    # A retry avoids the URLs this request already tried.
    assert pool.pick({"b"}).url == "c"
    assert pool.pick({"a", "c"}).url == "b"
    assert pool.pick({"a", "b", "c"}).url in {"a", "b", "c"}


def test_least_loaded_and_recently_failed() -> None:
    pool = EndpointPool(["a", "b", "c"], "least_loaded")
    a, b, c = pool.endpoints
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert pool.pick(set()).url == "b"
    b.avoid_until = float("inf")  # b just failed: used only when nothing else is left
    assert pool.pick(set()).url == "c"
    assert pool.pick({"a", "c"}).url == "b"


def test_auth_header_from_env() -> None:
    config = HttpScorerConfig(name="h", urls=["http://x/"], token_env="RM_TOKEN")
    scorer = HttpScorer(config, env={"RM_TOKEN": "s3cret"})
    assert scorer._headers == {"Authorization": "Bearer s3cret"}
    raw = HttpScorerConfig(
        name="h",
        urls=["http://x/"],
        token_env="K",
        auth_header="X-Api-Key",
        auth_scheme="",
    )
    assert HttpScorer(raw, env={"K": "k1"})._headers == {"X-Api-Key": "k1"}
    with pytest.raises(ValueError, match="environment variable RM_TOKEN"):
        HttpScorer(config, env={})


def test_one_line_flattens_and_cuts() -> None:
    assert one_line("Internal Server Error\n  Traceback (most recent call last):\n\tboom") == (
        "Internal Server Error Traceback (most recent call last): boom"
    )
    assert one_line("x" * 500, limit=10) == "xxxxxxx..."
