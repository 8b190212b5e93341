"""Stream lag and pending on the Prometheus endpoint come from a real Redis (a real HTTP scrape)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis
from prom_scrape import scrape

from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import PromMetrics


@pytest.fixture
def metrics() -> Iterator[PromMetrics]:
    served = PromMetrics()
    served.serve("127.0.0.1", 0, token=None)
    yield served
    served.close()


def test_a_scrape_returns_every_metric(metrics: PromMetrics, redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    for i in range(5):
        client.xadd(names.trajectories, {"d": str(i)})
    client.xgroup_create(names.trajectories, "reward", id="0")
    client.xgroup_create(names.trajectories, "audit", id="$")
    client.xreadgroup("reward", "r-0", {names.trajectories: ">"}, count=2)  # 2 pending, 3 not yet delivered
    metrics.watch_streams(redis_url, {"trajectories": names.trajectories, "scored": names.scored})  # scored: no key yet
    snapshot = {
        "processed": 40,
        "failed": 3,
        "retried": 2,
        "dead_lettered": 1,
        "in_flight": 6,
        "policy_version": 9,
        "status": "running",
    }
    metrics.watch_consumers(lambda: snapshot)
    metrics.count_samples("scored", 16, num_tokens=1200)
    metrics.count_samples("scored", 4)
    metrics.observe_staleness([0, 1, 1, 3])
    metrics.observe_weight_sync(0.02, "zmq")
    metrics.observe_reward("math", latency_s=0.3, retries=2)
    metrics.observe_reward("math", latency_s=2.0, failed=True)
    metrics.set_engine_queue_depth(7)
    got = scrape(metrics.port)
    assert got[("streamrl_stream_lag", (("group", "reward"), ("stream", "trajectories")))] == 3
    assert got[("streamrl_stream_pending", (("group", "reward"), ("stream", "trajectories")))] == 2
    assert got[("streamrl_stream_lag", (("group", "audit"), ("stream", "trajectories")))] == 0
    assert not [k for k in got if ("stream", "scored") in k[1]]
    assert got[("streamrl_consumer_processed_total", ())] == 40
    assert got[("streamrl_consumer_dead_lettered_total", ())] == 1
    assert got[("streamrl_consumer_in_flight", ())] == 6 and got[("streamrl_policy_version", ())] == 9
    assert got[("streamrl_samples_total", (("stage", "scored"),))] == 20
    assert got[("streamrl_tokens_total", (("stage", "scored"),))] == 1200
    assert [got[("streamrl_staleness_bucket", (("le", le),))] for le in ("0.0", "1.0", "2.0", "3.0", "+Inf")] == [
        1,
        3,
        3,
        4,
        4,
    ]
    assert got[("streamrl_staleness_sum", ())] == 5
    assert got[("streamrl_weight_sync_seconds_count", (("path", "zmq"),))] == 1
    assert got[("streamrl_weight_sync_seconds_bucket", (("le", "0.025"), ("path", "zmq")))] == 1
    assert got[("streamrl_reward_latency_seconds_count", (("scorer", "math"),))] == 2
    assert got[("streamrl_reward_retries_total", (("scorer", "math"),))] == 2
    assert got[("streamrl_reward_failures_total", (("scorer", "math"),))] == 1
    assert got[("streamrl_engine_queue_depth", ())] == 7
    client.xack(names.trajectories, "reward", *[e for e, _ in client.xrange(names.trajectories, count=2)])
    assert scrape(metrics.port)[("streamrl_stream_pending", (("group", "reward"), ("stream", "trajectories")))] == 0


def test_a_stream_the_redis_user_may_not_inspect_is_left_out_with_one_warning(
    metrics: PromMetrics, redis_url: str, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    names = StreamNames(run_id)
    admin = redis.Redis.from_url(redis_url)
    admin.xadd(names.prompts, {"d": "1"})
    admin.xgroup_create(names.prompts, "rollout", id="0")
    admin.xadd(names.trajectories, {"d": "1"})
    admin.xgroup_create(names.trajectories, "reward", id="0")
    user = f"metrics-{run_id}"  # may inspect the groups of trajectories only
    admin.acl_setuser(
        user,
        enabled=True,
        passwords=["+pw-for-the-test"],
        keys=[names.trajectories],
        commands=["+xinfo|groups", "+ping"],
    )
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw-for-the-test@")
        metrics.watch_streams(url, {"prompts": names.prompts, "trajectories": names.trajectories})
        with caplog.at_level(logging.WARNING, logger="streamrl.common.telemetry.prom"):
            first, second = scrape(metrics.port), scrape(metrics.port)
    finally:
        admin.acl_deluser(user)
    for got in (first, second):
        assert got[("streamrl_stream_lag", (("group", "reward"), ("stream", "trajectories")))] == 1
        assert not [k for k in got if ("stream", "prompts") in k[1]]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "stream prompts" in warning and "NoPermissionError" in warning and "xinfo|groups" in warning
