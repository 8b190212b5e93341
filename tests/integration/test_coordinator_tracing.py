"""The coordinator service traced, in this event loop against a real Redis (the smoke recipe's task):
training prompts start traces, evaluation prompts carry unsampled contexts, scored samples arriving
through the consumer wait in their group and for the batch under their reward spans, the batch is a
trace of its own, and the scored stream and each batch's staleness reach the Prometheus registry."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import redis
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_coordinator import Harness

from streamrl.common.batch_payloads import resolve
from streamrl.common.codec import decode
from streamrl.common.messages import BatchManifest, PromptWorkItem, TrainingBatch
from streamrl.common.payload_format import unpack_payload
from streamrl.common.payloads import assemble
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import PromMetrics
from streamrl.common.telemetry.trace_schema import BATCH, BATCH_WAIT, GROUP_ID, GROUP_WAIT, ISSUE, REWARD
from streamrl.common.telemetry.tracing import Tracing, format_traceparent, parse_traceparent, setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig


def traceparent_of(span: ReadableSpan) -> str:
    return format_traceparent(span.context.trace_id, span.context.span_id, span.context.trace_flags)


def sampled(traceparent: str) -> bool:
    parsed = parse_traceparent(traceparent)
    return parsed is not None and bool(parsed[2] & 1)


@contextlib.asynccontextmanager
async def traced_coordinator(
    recipe: Path, run_id: str, redis_url: str, tracing: Tracing, metrics: PromMetrics
) -> AsyncIterator[Harness]:
    """The coordinator service (with the recipe's evaluation) running here, tracing into ``tracing``."""
    from streamrl.common.bus import Bus, connect
    from streamrl.common.config import load_config
    from streamrl.common.lifecycle import ServiceContext
    from streamrl.coordinator.config import CoordinatorConfig
    from streamrl.coordinator.service import CoordinatorService

    config = load_config(CoordinatorConfig, str(recipe), [f"--run_id={run_id}"], section="coordinator")
    names = StreamNames(run_id)
    bus = Bus(connect(redis_url), maxlen=config.redis.maxlen, max_message_bytes=config.redis.max_message_bytes)
    ctx = ServiceContext(
        service="coordinator",
        instance="t",
        config=config,
        bus=bus,
        names=names,
        stop=asyncio.Event(),
        tracing=tracing,
        metrics=metrics,
    )
    harness = Harness(redis.Redis.from_url(redis_url), names, Path(config.run_dir))
    harness.service_task = asyncio.create_task(CoordinatorService(config, ctx).run())
    try:
        yield harness
    finally:
        ctx.stop.set()
        await asyncio.wait_for(harness.service_task, 30)
        await bus.redis.aclose()


def test_a_traced_batch_through_the_running_service(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    exporter, reward_exporter = InMemorySpanExporter(), InMemorySpanExporter()
    config = TracingConfig(sampling="all")
    tracing = setup_tracing(config, service="coordinator", instance="t", run_id=run_id, run_dir="-", exporter=exporter)
    reward = setup_tracing(config, service="reward", instance="t", run_id=run_id, run_dir="-", exporter=reward_exporter)
    metrics = PromMetrics()
    waited_s = 0.3

    async def scenario() -> TrainingBatch:
        async with traced_coordinator(recipe, run_id, redis_url, tracing, metrics) as h:
            h.weights(0)
            await h.until(lambda: sum(not p.is_eval for p in h.prompts()) >= 8, "the prompts of batches 0 and 1")
            items = [p for p in h.prompts() if not p.is_eval and p.policy_version == 0]
            assert len(items) == 4 and any(p.is_eval for p in h.prompts())

            def score(item: PromptWorkItem, i: int) -> None:  # as the reward tier does, under the prompt's trace
                scored = reward.record(REWARD, item.traceparent, start_s=time.time(), end_s=time.time())
                h.score_one(item, i, float(i % 2), traceparent=scored)

            for item in items:
                score(item, 0)
            await asyncio.sleep(waited_s)  # the first sample of every group waits this long for the others
            for item in items:
                for i in range(1, item.sampling.n):
                    score(item, i)
            await h.until(lambda: h.client.xlen(h.names.batches) == 1, "batch 0")
            manifest = decode(h.client.xrange(h.names.batches)[0][1][b"d"], BatchManifest)
            payloads = [h.client.get(r.key) for r in manifest.samples]  # as the learner reads them
            return resolve(
                manifest,
                [assemble(r.scored, unpack_payload(p)) for r, p in zip(manifest.samples, payloads, strict=True)],
            )

    batch = asyncio.run(scenario())
    assert tracing.flush() and reward.flush()
    spans = list(exporter.get_finished_spans())
    named = {name: [s for s in spans if s.name == name] for name in (ISSUE, GROUP_WAIT, BATCH_WAIT, BATCH)}
    prompts = [decode(f[b"d"]) for _, f in redis.Redis.from_url(redis_url).xrange(StreamNames(run_id).prompts)]
    training = [p for p in prompts if not p.is_eval]
    assert {p.traceparent for p in training} == {traceparent_of(s) for s in named[ISSUE]}
    assert all(not sampled(p.traceparent) and parse_traceparent(p.traceparent) for p in prompts if p.is_eval)

    issues = {s.attributes[GROUP_ID]: s for s in named[ISSUE]}
    rewards = {s.context.span_id: s for s in reward_exporter.get_finished_spans()}
    group_waits = {s.context.span_id: s for s in named[GROUP_WAIT]}
    batch_waits = {traceparent_of(s): s for s in named[BATCH_WAIT]}
    assert len(batch.samples) == len(group_waits) == len(batch_waits) == 16
    complete: dict[str, set[int]] = {}
    for sample in batch.samples:
        traj = sample.trajectory
        batched = batch_waits[sample.traceparent]  # the batch carries each sample's batch-wait context
        waited = group_waits[batched.parent.span_id]
        assert rewards[waited.parent.span_id].parent.span_id == issues[traj.group_id].context.span_id
        assert batched.start_time == waited.end_time
        complete.setdefault(traj.group_id, set()).add(waited.end_time)
        group_wait_s = (waited.end_time - waited.start_time) / 1e9
        assert group_wait_s >= 0.9 * waited_s if traj.group_index == 0 else group_wait_s < 0.9 * waited_s
    assert all(len(ends) == 1 for ends in complete.values())  # a group completes once, for all its members
    (batch_span,) = named[BATCH]
    assert batch.traceparent == traceparent_of(batch_span)
    assert metrics.registry.get_sample_value("streamrl_staleness_count") == 16
    assert metrics.registry.get_sample_value("streamrl_samples_total", {"stage": "batched"}) == 16
    assert (
        metrics.registry.get_sample_value("streamrl_stream_pending", {"stream": "scored", "group": "coordinator"}) == 0
    )
    metrics.close()
    tracing.shutdown()
    reward.shutdown()
