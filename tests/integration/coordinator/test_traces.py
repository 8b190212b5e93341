"""The coordinator's spans of one prompt group against a real Redis: issue -> (the other tiers) -> group
wait -> batch wait, each sample's chain continued in the batch, the batch a trace of its own.

The coordinator's pieces run as the service wires them (issuer, the scored handler's arrival note, the
group buffer, the batch builder), with the SDK's in-memory exporter; the rollout and reward tiers are
one stand-in process recording a reward span per sample below the prompt's traceparent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from coordinator_fakes import Prompts, config, sample, store
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streamrl.common.batch_payloads import fetch_batch
from streamrl.common.codec import decode, encode
from streamrl.common.messages import BatchManifest, PromptWorkItem, ScoredRecord, TrainingBatch
from streamrl.common.telemetry.trace_schema import (
    BATCH,
    BATCH_ID,
    BATCH_WAIT,
    GROUP_ID,
    GROUP_WAIT,
    ISSUE,
    NUM_SAMPLES,
    POLICY_VERSION,
    REWARD,
    STEP_INDEX,
    TRAJECTORY_ID,
    VERSION_START,
)
from streamrl.common.telemetry.tracing import Tracing, format_traceparent, setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig
from streamrl.coordinator.batches import BatchBuilder
from streamrl.coordinator.groups import GroupBuffer
from streamrl.coordinator.issuing import PromptIssuer
from streamrl.coordinator.state import RunState
from streamrl.coordinator.traces import STORED_AT, is_sampled, note_arrival


class Process:
    """One process's tracing, exporting into memory."""

    def __init__(self, name: str, config: TracingConfig) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing: Tracing = setup_tracing(
            config, service=name, instance=f"{name}-0", run_id="r1", run_dir="unused", exporter=self.exporter
        )

    def spans(self, name: str) -> list[ReadableSpan]:
        assert self.tracing.flush()
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


@pytest.fixture
def processes() -> Iterator[tuple[Process, Process]]:
    """The coordinator (tracing every group), and the rollout + reward tiers."""
    made = Process("coordinator", TracingConfig(sampling="all")), Process("reward", TracingConfig(sampling="all"))
    yield made
    for process in made:
        process.tracing.shutdown()


def traceparent_of(span: ReadableSpan) -> str:
    return format_traceparent(span.context.trace_id, span.context.span_id, span.context.trace_flags)


async def one_batch(
    state: RunState, coordinator: Tracing, reward: Tracing, arrivals: tuple[float, ...]
) -> TrainingBatch:
    """Issue one group of ``len(arrivals)`` samples, score them (stored at those times), build its batch;
    the batch as the learner decodes it."""
    group_size = len(arrivals)
    cfg = config(group_size=group_size, prompts_per_step=1, max_staleness=0, prefetch_steps=0, wait_for_learner=False)
    groups = GroupBuffer(state, group_size=group_size, dynamic_filtering=False)
    issuer = PromptIssuer(cfg, state, groups, Prompts(), tracing=coordinator)  # type: ignore[arg-type]
    assert await issuer.issue(version=0) == 1
    ((_, fields),) = await state.redis.xrange(state.names.prompts)
    item = decode(fields[b"d"], PromptWorkItem)
    for i, arrived in enumerate(arrivals):
        scored = reward.record(REWARD, item.traceparent, start_s=arrived - 0.5, end_s=arrived - 0.1)
        received = decode(encode(sample(item.id, i, version=0, traceparent=scored)), ScoredRecord)
        note_arrival(received, arrived)  # what the scored handler does before the consumer stores it
        await store(state, item.id, received)
    await groups.complete(None)
    builder = BatchBuilder(state, groups, prompts_per_step=1, max_staleness=0, drop_stale=True, tracing=coordinator)
    (built,) = await builder.build(version=0)
    ((_, fields),) = await state.redis.xrange(state.names.batches)
    batch = await fetch_batch(state.redis, decode(fields[b"d"], BatchManifest), max_reply_bytes=2**20)
    assert [(s.trajectory.id, s.traceparent) for s in batch.samples] == [
        (s.trajectory.id, s.traceparent) for s in built.batch.samples
    ]
    return batch


def test_a_groups_samples_chain_issue_reward_group_wait_batch_wait(in_redis, processes) -> None:  # type: ignore[no-untyped-def]
    coordinator, reward = processes
    t0 = time.time()
    arrivals = (t0 - 3.0, t0 - 1.0)
    batch = in_redis(lambda state: one_batch(state, coordinator.tracing, reward.tracing, arrivals))

    (issue,) = coordinator.spans(ISSUE)
    assert issue.parent is None and issue.context.trace_flags.sampled
    assert dict(issue.attributes or {}) == {GROUP_ID: "p0", POLICY_VERSION: 0}
    scored = {s.context.span_id: s for s in reward.spans(REWARD)}
    assert len(scored) == 2 and all(s.parent.span_id == issue.context.span_id for s in scored.values())

    group_waits = {s.attributes[TRAJECTORY_ID]: s for s in coordinator.spans(GROUP_WAIT)}
    batch_waits = {s.attributes[TRAJECTORY_ID]: s for s in coordinator.spans(BATCH_WAIT)}
    assert sorted(group_waits) == sorted(batch_waits) == ["p0/0", "p0/1"]
    complete_ns = int((t0 - 1.0) * 1e9)  # the group is complete when its last member arrives
    for i, trained in enumerate(batch.samples):
        tid = trained.trajectory.id
        waited, batched = group_waits[tid], batch_waits[tid]
        assert (
            waited.parent.span_id in scored and scored[waited.parent.span_id].context.trace_id == issue.context.trace_id
        )
        assert dict(waited.attributes or {}) == {GROUP_ID: "p0", TRAJECTORY_ID: tid}
        assert waited.start_time == int(arrivals[i] * 1e9) and waited.end_time == complete_ns
        assert batched.parent.span_id == waited.context.span_id
        assert dict(batched.attributes or {}) == {BATCH_ID: "batch-0", TRAJECTORY_ID: tid, VERSION_START: 0}
        assert batched.start_time == complete_ns and batched.end_time == int(batch.created_at * 1e9)
        assert trained.traceparent == traceparent_of(batched)  # the learner's training span hangs below it
        assert trained.trajectory.timings[STORED_AT] == pytest.approx(arrivals[i])
    # the first sample waited 2 s for its group, the second none
    assert [group_waits[t].end_time - group_waits[t].start_time for t in ("p0/0", "p0/1")] == [2_000_000_000, 0]

    (batch_span,) = coordinator.spans(BATCH)
    assert batch_span.parent is None and batch_span.context.trace_id != issue.context.trace_id
    assert batch.traceparent == traceparent_of(batch_span)
    assert dict(batch_span.attributes or {}) == {BATCH_ID: "batch-0", STEP_INDEX: 0, POLICY_VERSION: 0, NUM_SAMPLES: 2}


def test_an_unsampled_group_gets_no_sample_spans_and_its_batch_is_still_traced(in_redis, processes) -> None:  # type: ignore[no-untyped-def]
    coordinator = Process("coordinator", TracingConfig(sampling="ratio", ratio=1e-9))  # practically never
    _, reward = processes
    try:
        batch = in_redis(lambda state: one_batch(state, coordinator.tracing, reward.tracing, (time.time(),) * 2))
        assert coordinator.spans(ISSUE) == reward.spans(REWARD) == []
        assert coordinator.spans(GROUP_WAIT) == coordinator.spans(BATCH_WAIT) == []
        assert all(not is_sampled(s.traceparent) and STORED_AT not in s.trajectory.timings for s in batch.samples)
        (batch_span,) = coordinator.spans(BATCH)  # per-step spans are recorded whatever the ratio
        assert batch.traceparent == traceparent_of(batch_span)
    finally:
        coordinator.tracing.shutdown()
