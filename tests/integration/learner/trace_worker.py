"""One traced learner life for test_learner_tracing.py, in its own process (DeepSpeed initialises
torch.distributed, which must not be left behind in the pytest process): the real service in burst
mode over the batches already in the stream, spans into the SDK's in-memory exporter, metrics into a
Prometheus registry of its own. Writes what it recorded as JSON to OUT.

    python trace_worker.py MODEL REDIS_URL RUN_ID RUN_DIR OUT
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streamrl.common.bus import Bus, connect
from streamrl.common.config import RedisConfig
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import PromMetrics
from streamrl.common.telemetry.tracing import setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.rl.algo.config import AlgoConfig, CorrectionConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.group import LearnerGroup
from streamrl.learner.rl.service import LearnerService
from streamrl.learner.rl.trainer import RLTrainer

TRACING = TracingConfig(sampling="tail", tail_min_staleness=1, tail_slow_s=60.0)
"""Every span recorded; a sample one version behind or slower than 60 s is marked."""


async def life(model: str, redis_url: str, run_id: str, run_dir: str, out: str) -> None:
    cfg = LearnerConfig(
        model=model,
        run_id=run_id,
        run_dir=run_dir,
        total_steps=2,
        checkpoint_every=2,
        redis=RedisConfig(url=redis_url),
        tracing=TRACING,
        ds=DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant", lr=1e-2),
        algo=AlgoConfig(correction=CorrectionConfig(type="icepop", low=0.8, high=1.25)),
    )
    exporter = InMemorySpanExporter()
    tracing = setup_tracing(
        TRACING, service="learner", instance="learner-0", run_id=run_id, run_dir=run_dir, exporter=exporter
    )
    metrics = PromMetrics()
    trainer = RLTrainer(cfg)
    group = LearnerGroup(trainer, Path(run_dir) / "checkpoints", cfg.checkpoint_keep_last)
    bus = Bus(connect(redis_url))
    ctx = ServiceContext(
        "learner",
        "learner-0",
        cfg,
        bus,
        StreamNames(run_id),
        asyncio.Event(),
        burst=True,
        tracing=tracing,
        metrics=metrics,
    )
    try:
        await LearnerService(cfg, ctx, trainer, group).run()
    finally:
        await bus.redis.aclose()
    assert tracing.flush()
    spans = [
        {
            "name": s.name,
            "trace_id": s.context.trace_id,
            "span_id": s.context.span_id,
            "parent": None if s.parent is None else [s.parent.trace_id, s.parent.span_id],
            "attributes": dict(s.attributes or {}),
            "links": [[k.context.trace_id, k.context.span_id] for k in s.links],
            "error": s.status.description if not s.status.is_ok else None,
        }
        for s in exporter.get_finished_spans()
    ]
    value = metrics.registry.get_sample_value
    prom: dict[str, Any] = {
        "trained": value("streamrl_samples_total", {"stage": "trained"}),
        "trained_tokens": value("streamrl_tokens_total", {"stage": "trained"}),
        "staleness_count": value("streamrl_staleness_count"),
        "staleness_sum": value("streamrl_staleness_sum"),
        "weight_syncs": value("streamrl_weight_sync_seconds_count", {"path": "zmq"}),
        "batches_pending": value("streamrl_stream_pending", {"stream": "batches", "group": "learner"}),
    }
    metrics.close()
    tracing.shutdown()
    Path(out).write_text(json.dumps({"spans": spans, "prom": prom}))


if __name__ == "__main__":
    asyncio.run(life(*sys.argv[1:6]))
