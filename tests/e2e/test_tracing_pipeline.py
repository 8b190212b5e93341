"""A short ``streamrl up`` of the smoke recipe exporting its traces over OTLP/HTTP, and its four
Prometheus endpoints scraped while it runs.

The receiver is a real OTLP/HTTP endpoint started by the test (:mod:`otlp_receiver`: protobuf
``ExportTraceServiceRequest`` decoded with ``opentelemetry-proto``); the services reach it through
``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``tracing.exporter = "otlp-http"`` and ``sampling = "all"``.
The reward function fails twice for about one response in eight (``flaky_digit_reward.py``), so
some samples are scored only at a redelivery, and ``max_staleness = 1`` lets samples be trained a
version late. Checked against what the streams say was trained (every ``WeightsPublished`` of a
step names its batch): each trained sample has exactly one complete chain issue -> queue ->
generate -> reward -> group wait -> batch wait -> train, every link the parent of the next, in one
trace; its training span's staleness is the learner's (the step's ``learner/staleness_*`` and the
batch's own staleness list); failed reward attempts are siblings without children; each step span
hangs under its batch span and links to exactly its samples' spans. Each endpoint, scraped over
HTTP while the run goes on, exports the metrics the services promise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import redis
from otlp_receiver import OtlpReceiver
from prometheus_client.parser import text_string_to_metric_families
from recipe_run import entries, trained_batches

from streamrl.common.messages import WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.trace_file import SpanRecord
from streamrl.common.telemetry.trace_schema import (
    ATTEMPT,
    BATCH,
    BATCH_ID,
    BATCH_WAIT,
    GENERATE,
    GROUP_ID,
    GROUP_WAIT,
    ISSUE,
    POLICY_VERSION,
    QUEUE,
    REWARD,
    STALENESS,
    STEP,
    TRAIN,
    TRAJECTORY_ID,
    VERSION_START,
    WEIGHTS_LOAD,
    WEIGHTS_PUBLISH,
)
from streamrl.common.telemetry.tracing import parse_traceparent, weights_traceparent
from streamrl.ops.redis_server import free_port
from streamrl.ops.trace_report import build_report, format_report

pytestmark = pytest.mark.slow
SERVICES = ("coordinator", "rollout", "reward", "learner")
ENV = {
    **os.environ,
    "STREAMRL_REDIS__RETAIN_CONSUMED_S": "86400",
    "STREAMRL_REDIS__PAYLOAD_RETENTION_S": "86400",  # trained and evaluation payloads stay readable
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "2",
    "TOKENIZERS_PARALLELISM": "false",
}
CHAIN = (TRAIN, BATCH_WAIT, GROUP_WAIT, REWARD, GENERATE, QUEUE, ISSUE)
"""A trained sample's spans from its training span up to its trace's root."""
CHAIN_SERVICE = {
    TRAIN: "learner",
    BATCH_WAIT: "coordinator",
    GROUP_WAIT: "coordinator",
    REWARD: "reward",
    GENERATE: "rollout",
    QUEUE: "rollout",
    ISSUE: "coordinator",
}
SCRAPE_TIMEOUT_S = 2.0

# (sample name, labels that must be there) -> does the value count? Every service exports its
# consumer counters; each watches the lag and pending entries of its input stream.
INPUT = {
    "coordinator": ("scored", "coordinator"),
    "rollout": ("prompts", "rollout"),
    "reward": ("trajectories", "reward"),
    "learner": ("batches", "learner"),
}
EXPECTED: dict[str, list[tuple[str, dict[str, str], bool]]] = {
    "coordinator": [
        ("streamrl_samples_total", {"stage": "batched"}, True),
        ("streamrl_staleness_count", {}, True),
    ],
    "rollout": [
        ("streamrl_samples_total", {"stage": "generated"}, True),
        ("streamrl_tokens_total", {"stage": "generated"}, True),
        ("streamrl_weight_sync_seconds_count", {"path": "zmq"}, True),
        ("streamrl_engine_queue_depth", {}, False),
    ],
    "reward": [
        ("streamrl_samples_total", {"stage": "scored"}, True),
        ("streamrl_reward_latency_seconds_count", {"scorer": "arithmetic"}, True),
        ("streamrl_reward_failures_total", {"scorer": "arithmetic"}, True),
    ],
    "learner": [
        ("streamrl_samples_total", {"stage": "trained"}, True),
        ("streamrl_tokens_total", {"stage": "trained"}, True),
        ("streamrl_staleness_count", {}, True),
        ("streamrl_weight_sync_seconds_count", {"path": "zmq"}, True),
    ],
}
"""Per service: samples that must be in a scrape taken while the run goes on, and whether their
value must be above 0 by then (a gauge may read 0)."""
FAMILIES = {
    "reward": {"streamrl_reward_retries", "streamrl_reward_failures", "streamrl_reward_latency_seconds"},
    "rollout": {"streamrl_engine_queue_depth", "streamrl_weight_sync_seconds"},
    "learner": {"streamrl_staleness", "streamrl_weight_sync_seconds"},
    "coordinator": {"streamrl_staleness"},
}
"""Metric families each endpoint declares (a labelled counter with no sample yet still has its HELP
and TYPE: a function scorer never retries a call, so reward_retries has none)."""


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of a Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def missing(service: str, text: str) -> list[str]:
    """What a scrape of ``service`` lacks of :data:`EXPECTED` (values above 0 where required)."""
    values = samples(text)
    stream, group = INPUT[service]
    wanted = [
        *EXPECTED[service],
        ("streamrl_stream_lag", {"stream": stream, "group": group}, False),
        ("streamrl_stream_pending", {"stream": stream, "group": group}, False),
        ("streamrl_consumer_processed_total", {}, True),
    ]
    out = []
    for name, labels, positive in wanted:
        value = values.get((name, frozenset(labels.items())))
        if value is None or (positive and value <= 0):
            out.append(f"{name}{labels}={value}")
    out += [f"family {f}" for f in FAMILIES[service] - families(text)]
    return out


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
            text: str = response.read().decode()
            return text
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None  # not up yet, or already gone


def scrape_while_running(proc: subprocess.Popen[bytes], ports: dict[str, int], timeout_s: float) -> dict[str, str]:
    """Scrape every endpoint each 0.5 s until each one has shown everything expected (that scrape is
    kept) or the run ends (the last scrape is kept); then wait for the run to end."""
    kept: dict[str, str] = {}
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and done != set(ports) and time.monotonic() < deadline:
        for service, port in ports.items():
            if service in done:
                continue
            text = scrape(port)
            if text is not None:
                kept[service] = text
                if not missing(service, text):
                    done.add(service)
        time.sleep(0.5)
    proc.wait(max(1.0, deadline - time.monotonic()))
    return kept


def span_id(traceparent: str) -> tuple[str, str]:
    parsed = parse_traceparent(traceparent)
    assert parsed is not None, traceparent
    return f"{parsed[0]:032x}", f"{parsed[1]:016x}"


def test_every_trained_sample_has_one_complete_trace_over_otlp_and_every_service_is_scraped(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    recipe = write_recipe(tiny_task, run_dir, redis_url, dense_reward=True)
    ports = {service: free_port() for service in SERVICES}
    log = tmp_path / "up.log"
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in ENV.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        cmd = [
            sys.executable,
            "-m",
            "streamrl.ops.cli",
            "up",
            str(recipe),
            f"--run_id={run_id}",
            "--tracing.exporter=otlp-http",
            "--tracing.sampling=all",
            "--coordinator.max_staleness=1",
            f"--reward.scorers.0.path={Path(__file__).parent / 'flaky_digit_reward.py'}",
            *(f"--{service}.prometheus.port={port}" for service, port in ports.items()),
        ]
        started = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                scraped = scrape_while_running(proc, ports, timeout_s=400)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        elapsed_s = time.monotonic() - started
        assert proc.returncode == 0, log.read_text()[-6000:]
        spans = receiver.spans()
        assert receiver.requests > 0 and not receiver.bad_requests, receiver.bad_requests
    print(f"run {elapsed_s:.0f} s, {receiver.requests} OTLP requests, {len(spans)} spans")

    # every endpoint answered during the run with the metrics of its service
    assert set(scraped) == set(SERVICES), f"endpoints never scraped: {set(SERVICES) - set(scraped)}"
    for service, text in scraped.items():
        assert not missing(service, text), f"{service} at :{ports[service]}: {missing(service, text)}"

    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    published = [m for m in entries(client, names.weights) if isinstance(m, WeightsPublished) and m.batch_id]
    batches = {m.id: m for m in trained_batches(client, names)}
    assert [w.version for w in published] == [1, 2, 3, 4]
    assert client.xlen(names.dead) == 0

    by_id = {(s.trace_id, s.span_id): s for s in spans}
    assert len(by_id) == len(spans), "a span was exported twice"
    children: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.parent_id:
            children[(s.trace_id, s.parent_id)].append(s)
    train_spans = defaultdict(list)
    generate_spans = defaultdict(list)
    for s in spans:
        if s.name == TRAIN:
            train_spans[s.attributes[TRAJECTORY_ID]].append(s)
        elif s.name == GENERATE:
            generate_spans[s.attributes[TRAJECTORY_ID]].append(s)

    trained_ids: list[str] = []
    expected_staleness: Counter[int] = Counter()
    retried = 0
    for event in published:
        batch = batches[event.batch_id]
        version = event.version - 1  # the learner's version while it trained the batch
        staleness = []
        for i, sample in enumerate(batch.samples):
            traj = sample.trajectory
            trained_ids.append(traj.id)
            (train,) = train_spans[traj.id]  # one training span per trained sample
            (generate,) = generate_spans[traj.id]  # generated once
            chain = [train]
            while chain[-1].parent_id:
                chain.append(by_id[(train.trace_id, chain[-1].parent_id)])  # parents exported, same trace
            assert tuple(s.name for s in chain) == CHAIN, [s.name for s in chain]
            assert chain[4] is generate
            assert all(s.service == f"streamrl-{CHAIN_SERVICE[s.name]}" for s in chain)
            assert all(s.status != 2 for s in chain), "a span on a trained sample's path failed"
            assert (train.trace_id, train.parent_id) == span_id(sample.traceparent)
            assert all(s.attributes[TRAJECTORY_ID] == traj.id for s in chain[:5])
            assert chain[6].attributes[GROUP_ID] == chain[5].attributes[GROUP_ID] == traj.group_id
            # the training span's staleness is what the learner trained with and logged
            assert train.attributes[POLICY_VERSION] == version
            assert generate.attributes[VERSION_START] == traj.policy_version_start
            assert train.attributes[STALENESS] == version - traj.policy_version_start == batch.staleness[i]
            staleness.append(train.attributes[STALENESS])
            # a reward attempt that failed is a sibling of the one that scored the sample, and leads nowhere
            reward = chain[3]
            attempts = [s for s in children[(generate.trace_id, generate.span_id)] if s.name == REWARD]
            failed = [s for s in attempts if s is not reward]
            assert all(s.status == 2 and not children[(s.trace_id, s.span_id)] for s in failed)
            assert sorted(s.attributes[ATTEMPT] for s in attempts) == list(range(1, len(attempts) + 1))
            assert reward.attributes[ATTEMPT] == len(attempts)
            retried += bool(failed)
        assert sum(staleness) / len(staleness) == pytest.approx(event.metrics["learner/staleness_mean"])
        assert max(staleness) == event.metrics["learner/staleness_max"]
        expected_staleness.update(staleness)

        # the step span: under the batch's span, linked to exactly the batch-wait span of each sample
        (step,) = [s for s in spans if s.name == STEP and s.attributes[BATCH_ID] == batch.id]
        parent = by_id[(step.trace_id, step.parent_id)]
        assert (
            parent.name == BATCH
            and not parent.parent_id
            and (step.trace_id, step.parent_id) == span_id(batch.traceparent)
        )
        assert sorted(step.links) == sorted(span_id(s.traceparent) for s in batch.samples)
        assert all(by_id[link].name == BATCH_WAIT for link in step.links)
        # the weights of the version it produced: one publish span, under that version's weights context
        trace_id, root = span_id(weights_traceparent(run_id, event.version))
        (publish,) = [s for s in children[(trace_id, root)] if s.name == WEIGHTS_PUBLISH]
        assert publish.attributes[POLICY_VERSION] == event.version

    # each version a rollout worker loaded: a load span beside that version's publish span
    loads = [s for s in spans if s.name == WEIGHTS_LOAD]
    assert loads
    for load in loads:
        assert (load.trace_id, load.parent_id) == span_id(weights_traceparent(run_id, load.attributes[POLICY_VERSION]))

    assert len(trained_ids) == len(set(trained_ids)) == 4 * 4 * 4
    assert retried >= 1, "no trained sample was scored at a redelivery: the flaky reward picked none"

    # the report `streamrl trace` prints agrees: every trained sample complete, the same staleness
    report = build_report(spans)
    print(format_report(report))
    assert report.num_complete == len(trained_ids)
    assert report.staleness == dict(sorted(expected_staleness.items()))
