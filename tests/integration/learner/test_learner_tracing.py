"""The learner's spans, driven through its handler: a step span per batch under the batch's trace and
linked to every traced sample, a training span per traced sample whose staleness is what the step's
metrics say, correction figures per sample, keep marks, a publish span per version, and the Prometheus
figures. The learner (DeepSpeed, torch.distributed) runs in its own process: trace_worker.py.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from msgspec.structs import replace
from test_trainer_updates import scored_batch

from streamrl.common.codec import decode, encode
from streamrl.common.messages import TrainingBatch, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.trace_schema import (
    BATCH_ID,
    CORRECTION_WEIGHT,
    KEEP,
    MASKED_FRACTION,
    NUM_BYTES,
    NUM_SAMPLES,
    POLICY_VERSION,
    STALENESS,
    STEP,
    STEP_INDEX,
    TRAIN,
    TRAJECTORY_ID,
    VERSION_START,
    WEIGHTS_PATH,
    WEIGHTS_PUBLISH,
)
from streamrl.common.telemetry.tracing import format_traceparent, parse_traceparent, weights_traceparent

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("trace_worker.py")


def context(sampled: bool) -> str:
    return format_traceparent(random.getrandbits(128), random.getrandbits(64), int(sampled))


def batch(index: int, contexts: list[str], versions: list[int], slow: int | None = None) -> TrainingBatch:
    """Batch ``index`` of 8 samples with these traceparents and behaviour versions; sample ``slow`` was
    issued 100 s ago, the others 1 s ago (per the rollout tier's timings)."""
    made = scored_batch(num_groups=4, group_size=2, seed=index)
    now = time.time()
    samples = []
    for i, (s, tp, v) in enumerate(zip(made.samples, contexts, versions, strict=True)):
        issued = now - (100.0 if i == slow else 1.0)
        traj = replace(
            s.trajectory,
            policy_version_start=v,
            policy_version_end=v,
            timings={"queue_s": 0.5, "started_at": issued + 0.5},
        )
        samples.append(replace(s, trajectory=traj, traceparent=tp))
    return TrainingBatch(
        id=f"batch-{index}",
        index=index,
        samples=samples,
        policy_version=index,
        staleness=[index - v for v in versions],
        traceparent=context(sampled=True),
    )


def ids(traceparent: str) -> list[int]:
    parsed = parse_traceparent(traceparent)
    assert parsed is not None
    return [parsed[0], parsed[1]]


def test_step_links_and_train_staleness_match_the_steps_metrics(
    tiny_qwen_dir: Path, tmp_path: Path, redis_url: str, run_id: str, worker_env: dict[str, str]
) -> None:
    # batch 0: traced, unsampled and untraced samples; batch 1: every sample traced, 0 to 1 versions behind
    first = batch(0, [context(True), context(False), "", context(True)] * 2, [0] * 8, slow=3)
    second = batch(1, [context(True) for _ in range(8)], [1, 0, 1, 0, 0, 0, 1, 1])
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for b in (first, second):
        client.xadd(names.batches, {"d": encode(b)})
    out = tmp_path / "recorded.json"
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tiny_qwen_dir), redis_url, run_id, str(tmp_path / "run"), str(out)],
        env={**worker_env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(out.read_text())
    spans: list[dict[str, Any]] = recorded["spans"]
    events = {e.version: e for e in (decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights))}
    assert sorted(events) == [0, 1, 2]

    for b in (first, second):
        (step,) = [s for s in spans if s["name"] == STEP and s["attributes"][BATCH_ID] == b.id]
        assert step["parent"] == ids(b.traceparent) and step["error"] is None
        traced = [i for i, s in enumerate(b.samples) if s.traceparent.endswith("-01")]
        assert sorted(step["links"]) == sorted(ids(b.samples[i].traceparent) for i in traced)
        assert step["attributes"][STEP_INDEX] == b.index and step["attributes"][NUM_SAMPLES] == 8
        metrics = events[b.index + 1].metrics  # the step that trains batch k (at version k) publishes k + 1
        assert step["attributes"][CORRECTION_WEIGHT] == metrics["learner/correction/weight_mean"]
        assert step["attributes"][MASKED_FRACTION] == metrics["learner/correction/masked_frac"]
        train = {
            s["attributes"][TRAJECTORY_ID]: s
            for s in spans
            if s["name"] == TRAIN and s["attributes"][STEP_INDEX] == b.index
        }
        assert sorted(train) == sorted(b.samples[i].trajectory.id for i in traced)  # none for the others
        for i in traced:
            traj = b.samples[i].trajectory
            span = train[traj.id]
            a = span["attributes"]
            assert span["parent"] == ids(b.samples[i].traceparent)
            assert a[STALENESS] == b.index - traj.policy_version_start
            assert a[POLICY_VERSION] == b.index and a[VERSION_START] == traj.policy_version_start
            assert 0.0 <= a[MASKED_FRACTION] <= 1.0 and a[CORRECTION_WEIGHT] >= 0.0
            reasons = ["stale"] * (a[STALENESS] >= 1) + ["slow"] * (b is first and i == 3)
            assert a.get(KEEP) == (",".join(reasons) or None)
    # batch 1 has every sample traced: its training spans say what the step logged
    train = [s["attributes"] for s in spans if s["name"] == TRAIN and s["attributes"][STEP_INDEX] == 1]
    metrics = events[2].metrics
    stale = [a[STALENESS] for a in train]
    assert sum(stale) / len(stale) == pytest.approx(metrics["learner/staleness_mean"])
    assert max(stale) == metrics["learner/staleness_max"] == 1
    tokens = {s.trajectory.id: len(s.trajectory.response_ids) for s in second.samples}  # loss masks all ones
    weighted = sum(a[CORRECTION_WEIGHT] * tokens[a[TRAJECTORY_ID]] for a in train) / sum(tokens.values())
    assert weighted == pytest.approx(metrics["learner/correction/weight_mean"], rel=1e-5)
    masked = sum(a[MASKED_FRACTION] * tokens[a[TRAJECTORY_ID]] for a in train) / sum(tokens.values())
    assert masked == pytest.approx(metrics["learner/correction/masked_frac"], rel=1e-5, abs=1e-7)

    publish = {s["attributes"][POLICY_VERSION]: s for s in spans if s["name"] == WEIGHTS_PUBLISH}
    assert sorted(publish) == [0, 1, 2]
    for version, span in publish.items():
        assert span["parent"] == ids(weights_traceparent(run_id, version))
        assert span["attributes"][NUM_BYTES] == events[version].num_bytes > 0
        assert span["attributes"][WEIGHTS_PATH] == "zmq"

    prom = recorded["prom"]
    staleness = [0] * 8 + [1 - v for v in [1, 0, 1, 0, 0, 0, 1, 1]]
    assert prom["trained"] == prom["staleness_count"] == 16 and prom["staleness_sum"] == sum(staleness)
    assert prom["trained_tokens"] == sum(events[v].metrics["learner/tokens"] for v in (1, 2))
    assert prom["weight_syncs"] == 3 and prom["batches_pending"] is not None
