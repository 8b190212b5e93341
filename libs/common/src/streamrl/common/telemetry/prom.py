"""Prometheus metrics of one service process: its own registry, served on ``/metrics`` while it runs.

    metrics = setup_metrics(config.prometheus)          # the null Metrics when prometheus.port = 0
    metrics.watch_streams(config.redis.url, {"trajectories": names.trajectories})
    metrics.watch_consumers(ctx.snapshot)
    metrics.observe_reward("math", latency_s=0.8, retries=1)
    metrics.close()                                      # on exit

What is exported (every name prefixed ``streamrl_``)::

    stream_lag{stream,group}             entries not yet delivered to the group    XINFO GROUPS, at each scrape
    stream_pending{stream,group}         delivered, not yet acknowledged           XINFO GROUPS, at each scrape
    consumer_{processed,failed,retried,dead_lettered}_total, consumer_in_flight, policy_version
                                         this instance's heartbeat counters, at each scrape
    samples_total{stage}, tokens_total{stage}       throughput (generated, scored, trained, ...)
    weight_sync_seconds{path}            histogram: one weight update, zmq / ipc / broadcast
    staleness                            histogram: learner version - behaviour version of trained samples
    reward_latency_seconds{scorer}, reward_retries_total{scorer}, reward_failures_total{scorer}
    engine_queue_depth                   requests waiting in or running on the engine

The endpoint is a small threaded WSGI server; with ``prometheus.token_env`` set every scrape must
carry ``Authorization: Bearer <token>`` (401 otherwise). Scrape-time values are read in the
server's thread with a synchronous Redis client of their own.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from redis.exceptions import RedisError, ResponseError

from streamrl.common.errors import ConfigError
from streamrl.common.telemetry.prom_config import PromConfig

logger = logging.getLogger(__name__)
SCRAPE_REDIS_TIMEOUT_S = 2.0
"""A scrape waits at most this long for Redis (s); Prometheus' default scrape timeout is 10 s."""
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
WEIGHT_SYNC_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REWARD_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CONSUMER_COUNTERS = {
    "processed": "Entries handled and committed by this instance.",
    "failed": "Handler failures (each failed delivery counts).",
    "retried": "Entries retried by this instance after a failure.",
    "dead_lettered": "Entries given up on and dead-lettered.",
}


class Metrics:
    """What services call to update their metrics. This base records nothing: it is the metrics of a
    service without an endpoint (``prometheus.port = 0``); :class:`PromMetrics` records."""

    @property
    def port(self) -> int:
        """Port the endpoint listens on (0 = none)."""
        return 0

    def count_samples(self, stage: str, num_samples: int, num_tokens: int = 0) -> None:
        """``num_samples`` samples (``num_tokens`` tokens) went through ``stage``: generated, scored, trained."""

    def observe_staleness(self, values: Iterable[int]) -> None:
        """Staleness of each trained sample (learner version - behaviour version)."""

    def observe_weight_sync(self, seconds: float, path: str) -> None:
        """One weight update took ``seconds`` over ``path`` (``zmq``, ``ipc``, ``broadcast``)."""

    def observe_reward(self, scorer: str, *, latency_s: float, retries: int = 0, failed: bool = False) -> None:
        """One scorer call: its latency, the retries it took, whether it failed in the end."""

    def set_engine_queue_depth(self, depth: int) -> None:
        """Requests waiting in or running on the engine now."""

    def watch_streams(self, redis_url: str, streams: Mapping[str, str]) -> None:
        """Export lag and pending counts of every consumer group of ``streams`` (label -> key) at each scrape."""

    def watch_consumers(self, snapshot: Callable[[], Mapping[str, int | str | float]]) -> None:
        """Export the instance's consumer counters (``ServiceContext.snapshot``) at each scrape."""

    def close(self) -> None:
        """Stop the endpoint."""


NULL_METRICS = Metrics()


class StreamGroupsCollector(Collector):
    """Lag and pending entries per consumer group, from ``XINFO GROUPS`` when scraped.

    Needs ``xinfo|groups`` on the streams in the service's Redis ACL. A stream not created yet has no
    groups; a refused or failed call leaves its stream out of that scrape (one warning per stream).
    """

    def __init__(self, redis_url: str, streams: Mapping[str, str]) -> None:
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=SCRAPE_REDIS_TIMEOUT_S, socket_connect_timeout=SCRAPE_REDIS_TIMEOUT_S
        )
        self._streams = dict(streams)
        self._warned: set[str] = set()

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "streamrl_stream_lag",
                "Entries of the stream not yet delivered to the consumer group.",
                labels=["stream", "group"],
            ),
            GaugeMetricFamily(
                "streamrl_stream_pending",
                "Entries delivered to the consumer group, not yet acknowledged.",
                labels=["stream", "group"],
            ),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        lag, pending = self._families()
        for label, key in self._streams.items():
            for group in self._groups(label, key):
                name = group["name"].decode() if isinstance(group["name"], bytes) else str(group["name"])
                pending.add_metric([label, name], group["pending"])
                if group.get("lag") is not None:  # None when Redis cannot tell (Redis >= 7 reports it)
                    lag.add_metric([label, name], group["lag"])
        return [lag, pending]

    def _groups(self, label: str, key: str) -> list[dict[str, Any]]:
        try:
            groups: list[dict[str, Any]] = self._redis.xinfo_groups(key)
        except ResponseError as e:
            if "no such key" in str(e):
                return []
            self._warn_once(label, e)
            return []
        except RedisError as e:
            self._warn_once(label, e)
            return []
        return groups

    def _warn_once(self, label: str, error: RedisError) -> None:
        if label not in self._warned:
            self._warned.add(label)
            logger.warning(
                "metrics: no lag or pending counts for stream %s: %s: %s (the service's Redis user "
                "needs xinfo|groups on it)",
                label,
                type(error).__name__,
                error,
            )

    def close(self) -> None:
        self._redis.close()


class ConsumerCountersCollector(Collector):
    """The instance's heartbeat counters (processed, failed, ...) when scraped."""

    def __init__(self, snapshot: Callable[[], Mapping[str, int | str | float]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        for key, doc in CONSUMER_COUNTERS.items():
            yield CounterMetricFamily(f"streamrl_consumer_{key}", doc, value=int(snap[key]))
        yield GaugeMetricFamily(
            "streamrl_consumer_in_flight", "Entries being handled now.", value=int(snap["in_flight"])
        )
        yield GaugeMetricFamily(
            "streamrl_policy_version",
            "Policy version this instance serves or trains (-1 = n/a).",
            value=int(snap["policy_version"]),
        )


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


def _with_token(app: Callable[..., Any], token: str) -> Callable[..., Any]:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if not hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode(), expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required\n"]
        return app(environ, start_response)

    return guarded


class PromMetrics(Metrics):
    """Metrics in a registry of this process, served over HTTP by :meth:`serve`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._samples = Counter("streamrl_samples", "Samples through a stage.", ["stage"], registry=r)
        self._tokens = Counter("streamrl_tokens", "Tokens through a stage.", ["stage"], registry=r)
        self._staleness = Histogram(
            "streamrl_staleness",
            "Learner version - behaviour version of trained samples.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self._weight_sync = Histogram(
            "streamrl_weight_sync_seconds",
            "One weight update, by path.",
            ["path"],
            buckets=WEIGHT_SYNC_BUCKETS_S,
            registry=r,
        )
        self._reward_latency = Histogram(
            "streamrl_reward_latency_seconds",
            "One scorer call.",
            ["scorer"],
            buckets=REWARD_LATENCY_BUCKETS_S,
            registry=r,
        )
        self._reward_retries = Counter("streamrl_reward_retries", "Scorer calls retried.", ["scorer"], registry=r)
        self._reward_failures = Counter(
            "streamrl_reward_failures", "Scorer calls failed for good.", ["scorer"], registry=r
        )
        self._queue_depth = Gauge(
            "streamrl_engine_queue_depth", "Requests waiting in or running on the engine.", registry=r
        )
        self._streams: list[StreamGroupsCollector] = []
        self._server: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_port if self._server is not None else 0

    def count_samples(self, stage: str, num_samples: int, num_tokens: int = 0) -> None:
        self._samples.labels(stage).inc(num_samples)
        if num_tokens:
            self._tokens.labels(stage).inc(num_tokens)

    def observe_staleness(self, values: Iterable[int]) -> None:
        for value in values:
            self._staleness.observe(value)

    def observe_weight_sync(self, seconds: float, path: str) -> None:
        self._weight_sync.labels(path).observe(seconds)

    def observe_reward(self, scorer: str, *, latency_s: float, retries: int = 0, failed: bool = False) -> None:
        self._reward_latency.labels(scorer).observe(latency_s)
        if retries:
            self._reward_retries.labels(scorer).inc(retries)
        if failed:
            self._reward_failures.labels(scorer).inc()

    def set_engine_queue_depth(self, depth: int) -> None:
        self._queue_depth.set(depth)

    def watch_streams(self, redis_url: str, streams: Mapping[str, str]) -> None:
        collector = StreamGroupsCollector(redis_url, streams)
        self.registry.register(collector)
        self._streams.append(collector)

    def watch_consumers(self, snapshot: Callable[[], Mapping[str, int | str | float]]) -> None:
        self.registry.register(ConsumerCountersCollector(snapshot))

    def serve(self, host: str, port: int, token: str | None) -> None:
        """Listen on ``host:port`` (0 = a free port) in a daemon thread."""
        app = make_wsgi_app(self.registry)
        self._server = make_server(
            host,
            port,
            app if token is None else _with_token(app, token),
            ThreadingWSGIServer,
            handler_class=_QuietHandler,
        )
        self._thread = threading.Thread(target=self._server.serve_forever, name="prometheus", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for collector in self._streams:
            collector.close()


def setup_metrics(config: PromConfig, env: Mapping[str, str] | None = None) -> Metrics:
    """This process's metrics: :data:`NULL_METRICS` when ``config.port`` is 0, else a served :class:`PromMetrics`."""
    if not config.port:
        return NULL_METRICS
    env = os.environ if env is None else env
    token = None
    if config.token_env is not None:
        token = env.get(config.token_env, "")
        if not token:
            raise ConfigError(f"prometheus.token_env: environment variable {config.token_env} is not set")
    metrics = PromMetrics()
    try:
        metrics.serve(config.host, config.port, token)
    except OSError as e:
        raise ConfigError(f"prometheus.port: cannot listen on {config.host}:{config.port}: {e}") from e
    logger.info("metrics on http://%s:%d/metrics%s", config.host, metrics.port, " (bearer token)" if token else "")
    return metrics
