"""A traced learner group of 2 data-parallel ranks (gloo on CPU), run as ``streamrl learner`` with the
file exporter: rank 0 alone writes spans, and every trained sample's training span has its correction
figures, also for the rows the other rank trained (gathered from it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import redis
from msgspec.structs import replace
from test_learner_group import finish, learner, training_batch

from streamrl.common.codec import decode, encode
from streamrl.common.messages import WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.trace_file import read_spans, trace_files
from streamrl.common.telemetry.trace_schema import (
    CORRECTION_WEIGHT,
    MASKED_FRACTION,
    STALENESS,
    STEP,
    STEP_INDEX,
    TRAIN,
    TRAJECTORY_ID,
)
from streamrl.common.telemetry.tracing import format_traceparent
from streamrl.torchkit.testing import build_tiny_qwen2

pytestmark = pytest.mark.slow
STEPS = 2


def recipe(path: Path, model: Path, redis_url: str, run_id: str) -> Path:
    path.write_text(f"""
run_id = "{run_id}"
run_dir = "{path.parent / run_id}"
total_steps = {STEPS}

[redis]
url = "{redis_url}"

[tracing]
sampling = "all"
exporter = "file"

[learner]
model = "{model}"
ranks = 2
checkpoint_every = {STEPS}

[learner.algo.correction]
type = "icepop"
low = 0.8
high = 1.25

[learner.ds]
zero_stage = 2
dtype = "fp32"
lr = 0.01
scheduler = "constant"
micro_batch_size = 4
grad_accum = 2
""")
    return path


def test_rank_0_traces_every_sample_of_both_ranks(tmp_path: Path, redis_url: str, run_id: str) -> None:
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=64, vocab_size=384)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(STEPS):
        batch = training_batch(i)
        traced = [replace(s, traceparent=format_traceparent(random.getrandbits(128), 1 + i, 1)) for s in batch.samples]
        client.xadd(names.batches, {"d": encode(replace(batch, samples=traced))})
    finish(learner(recipe(tmp_path / "r.toml", model, redis_url, run_id), "--burst"))

    run_dir = tmp_path / run_id
    assert [f.name.split("-")[0] for f in trace_files(run_dir)] == ["learner"]  # one process: rank 0
    spans, bad = read_spans(run_dir)
    assert bad == 0
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    for step in range(STEPS):
        metrics = next(e.metrics for e in events if e.version == step + 1)
        train = [s.attributes for s in spans if s.name == TRAIN and s.attributes[STEP_INDEX] == step]
        (step_span,) = [s for s in spans if s.name == STEP and s.attributes[STEP_INDEX] == step]
        assert len(train) == len(step_span.links) == 20
        assert all(CORRECTION_WEIGHT in a and MASKED_FRACTION in a for a in train)
        assert sum(a[STALENESS] for a in train) / 20 == metrics["learner/staleness_mean"]
        # the mean over the samples of both ranks, weighted by their tokens (loss masks all ones), is the step's
        tokens = [len(s.trajectory.response_ids) for s in training_batch(step).samples]
        by_id = {a[TRAJECTORY_ID]: a for a in train}
        ordered = [by_id[s.trajectory.id] for s in training_batch(step).samples]
        weighted = sum(a[CORRECTION_WEIGHT] * n for a, n in zip(ordered, tokens, strict=True)) / sum(tokens)
        assert weighted == pytest.approx(metrics["learner/correction/weight_mean"], rel=1e-5)
