"""A password in an HTTP scorer's URL is sent, never written: a reward consumer on a real redis-server (AOF on)
scores through the test reward server (reward_server.py) with ``http://scorer:PASSWORD@...`` URLs - one down,
one failing with HTTP 500 until told otherwise, so entries fail, are retried and dead-lettered, then others are
scored - and no log line, metric, span, dead letter, stream entry, consumer counter or AOF byte holds the
password; every place that names a URL shows ``scorer:***@``."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from reward_server import ServerProcess

from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode
from streamrl.common.config import ConsumerConfig
from streamrl.common.consumer import ConsumerLoop, encode_payload
from streamrl.common.messages import DeadLetter, ScoredTrajectory, Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import PromMetrics
from streamrl.common.telemetry.tracing import setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig
from streamrl.ops.redis_server import RedisServer, free_port
from streamrl.reward.config import RewardConfig
from streamrl.reward.service import RewardService

PASSWORD = "pw-9f3c1e77d2"
SHOWN = "scorer:***@127.0.0.1"


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
        prompt_text=f"p{i}: ",
        response_text="rrr",
    )


def test_a_password_in_a_scorer_url_is_written_nowhere(
    tmp_path: Path, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    redis_server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    scorer_server = ServerProcess("--always", "500")
    scorer_server.start()
    up = scorer_server.url.replace("http://", f"http://scorer:{PASSWORD}@")
    down = f"http://scorer:{PASSWORD}@127.0.0.1:{free_port()}/get_reward"
    exporter = InMemorySpanExporter()
    tracing = setup_tracing(
        TracingConfig(sampling="all"), service="reward", instance="r0", run_id=run_id, run_dir="x", exporter=exporter
    )
    metrics = PromMetrics()
    names = StreamNames(run_id)
    scorer = {"type": "http", "name": "remote", "urls": [down, up], "max_retries": 2, "timeout_s": 5}
    config = RewardConfig(scorers=[{**scorer, "backoff_base_s": 0.01, "backoff_max_s": 0.02}], max_wait_ms=5)
    consumer = ConsumerConfig(block_ms=50, claim_interval_s=0.2, retry_delay_s=0.05, max_deliveries=2)

    async def main() -> tuple[list[ScoredTrajectory], list[DeadLetter], list[bytes], str, str]:
        redis = connect(redis_server.url)
        service = RewardService(config, names, tracing=tracing, metrics=metrics)

        def consumer_loop() -> ConsumerLoop[Trajectory]:
            return ConsumerLoop(
                Bus(redis),
                names,
                stream=names.trajectories,
                group="reward",
                consumer="r0",
                handler=service.handle,
                message_type=Trajectory,
                config=consumer,
            )

        try:
            for i in range(3):  # fail every delivery: dead-lettered
                await redis.xadd(names.trajectories, encode_payload(trajectory(i)))
            loop = consumer_loop()
            await asyncio.wait_for(loop.run(asyncio.Event(), burst=True), timeout=60)
            last_error = loop.stats.last_error
            scorer_server.control("none")
            for i in range(3, 6):  # scored
                await redis.xadd(names.trajectories, encode_payload(trajectory(i)))
            await asyncio.wait_for(consumer_loop().run(asyncio.Event(), burst=True), timeout=60)
            scored = [decode(f[b"d"], ScoredTrajectory) for _, f in await redis.xrange(names.scored)]
            dead = [decode(f[b"d"], DeadLetter) for _, f in await redis.xrange(names.dead)]
            raw: list[bytes] = []
            async for key in redis.scan_iter(match=f"*{run_id}*"):
                if await redis.type(key) == b"stream":
                    raw += [v for _, fields in await redis.xrange(key) for v in fields.values()]
                    raw.append(repr(await redis.xinfo_stream(key)).encode())
            return scored, dead, raw, last_error, repr(service.metrics())
        finally:
            await service.close()
            await redis.aclose()

    try:
        with caplog.at_level(logging.DEBUG):
            scored, dead, raw, last_error, counters = asyncio.run(main())
        assert tracing.flush()
        spans = exporter.get_finished_spans()
    finally:
        tracing.shutdown()
        scorer_server.kill()
        redis_server.stop()

    span_text = " ".join(
        f"{s.attributes} {s.status.description} {[(e.name, e.attributes) for e in s.events]}" for s in spans
    )
    written = {
        "log lines": caplog.text,
        "the consumer's last error (heartbeat)": last_error,
        "metrics": generate_latest(metrics.registry).decode() + counters,
        "spans": span_text,
        "dead letters": " ".join(letter.error for letter in dead),
        "stream entries": b" ".join(raw).decode(errors="replace"),
        "AOF": b"".join(p.read_bytes() for p in (tmp_path / "redis").rglob("*.aof*")).decode(errors="replace"),
    }
    assert written["AOF"], "no AOF written"
    assert [where for where, text in written.items() if PASSWORD in text] == []
    assert len(dead) == 3 and len(scored) == 3
    assert all(SHOWN in letter.error and "HTTP 500" in letter.error for letter in dead)
    assert SHOWN in caplog.text and SHOWN in last_error
    assert {s.scorer for s in scored} == {"remote:http"}
    assert len(spans) == 3 * 2 + 3 and SHOWN in span_text
