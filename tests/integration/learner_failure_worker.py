"""One learner life for test_learner_failures.py and test_learner_ambiguous.py, in its own process (a
learner in the pytest process would leave a torch.distributed group behind for later tests). Batch
``fail_index`` fails: after its first backward pass (``half``), as an out-of-memory error in a later
micro-batch would, or before any (``before``), as a bad input would; or the process dies right after
the checkpoint of its step, before its version is published (``die``), as a SIGKILL there would; or
it dies in the middle of its step (``kill``: exit 9, as an OOM-kill or a segfault would); or, once
per life, what follows its step fails: the checkpoint (``ckpt``), the final export (``export``) or
serving the weights of its version (``publish``).

    python learner_failure_worker.py MODEL REDIS_URL RUN_ID RUN_DIR FAIL_INDEX [MODE] [TOTAL_STEPS] [CKPT_EVERY]

Environment: ``MAX_DELIVERIES`` (default 2); ``TRAINED_LOG``: a file where each step appends a line
``{batch id} {sha256 of its samples, encoded}`` (what was trained, to compare with what was published);
``TIMELINE_LOG``: a file of lines ``{event} {batch id} {monotonic seconds}``, events ``fetch`` (its payloads'
read starts), ``step`` and ``stepped`` (its step starts, ends); ``STEP_SLEEP_S``: each step takes that long more;
``LANE_URLS``: comma-separated Redis URLs of the run's lanes (``lanes.urls``; the home on ``REDIS_URL``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from streamrl.common import batch_payloads
from streamrl.common.bus import Bus, connect
from streamrl.common.codec import encode
from streamrl.common.config import ConsumerConfig, RedisConfig
from streamrl.common.lanes import LanesConfig
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import BatchManifest, ScoredTrajectory, TrainingBatch
from streamrl.common.streams import StreamNames
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.group import LearnerGroup
from streamrl.learner.rl.service import LearnerService
from streamrl.learner.rl.trainer import RLTrainer


def mark(event: str, batch_id: str) -> None:
    if log := os.environ.get("TIMELINE_LOG"):
        with open(log, "a") as f:
            f.write(f"{event} {batch_id} {time.monotonic()}\n")


real_fetch_samples = batch_payloads.fetch_samples


async def fetch_samples(redis: Any, manifest: BatchManifest, *, max_reply_bytes: int) -> list[ScoredTrajectory]:
    mark("fetch", manifest.id)
    return await real_fetch_samples(redis, manifest, max_reply_bytes=max_reply_bytes)


batch_payloads.fetch_samples = fetch_samples  # what fetch_batch calls: the learner's reads, timed


def digest(batch: TrainingBatch) -> str:
    """sha256 of a batch's samples, encoded in order."""
    return hashlib.sha256(b"".join(encode(s) for s in batch.samples)).hexdigest()


async def life(
    model: str, redis_url: str, run_id: str, run_dir: str, fail_index: int, mode: str, total_steps: int, every: int
) -> None:
    cfg = LearnerConfig(
        model=model,
        run_id=run_id,
        run_dir=run_dir,
        total_steps=total_steps,
        checkpoint_every=every,
        ds=DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant", lr=1e-2),
        consumer=ConsumerConfig(max_deliveries=int(os.environ.get("MAX_DELIVERIES", "2")), retry_delay_s=0.0),
    )
    if lane_urls := os.environ.get("LANE_URLS", ""):
        urls = lane_urls.split(",")
        cfg = cfg.model_copy(
            update={"lanes": LanesConfig(count=len(urls), urls=urls), "redis": RedisConfig(url=redis_url)}
        )
    trainer = RLTrainer(cfg)
    real_step = trainer.step

    def step(batch: TrainingBatch) -> dict[str, Any]:
        mark("step", batch.id)
        time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))
        try:
            return failing_step(batch)
        finally:
            mark("stepped", batch.id)

    def failing_step(batch: TrainingBatch) -> dict[str, Any]:
        if log := os.environ.get("TRAINED_LOG"):
            with open(log, "a") as f:
                f.write(f"{batch.id} {digest(batch)}\n")
        if batch.index == fail_index and mode == "before":
            raise ValueError("a bad input (simulated)")
        if batch.index == fail_index and mode == "half":
            logits = trainer.policy(input_ids=torch.tensor([[5, 6, 7]])).logits
            trainer.policy.backward(logits.sum() * 0.0)
            raise RuntimeError("CUDA out of memory (simulated) in micro-batch 2")
        if batch.index == fail_index and mode == "kill":
            os._exit(9)
        return real_step(batch)

    trainer.step = step  # type: ignore[method-assign]
    group = LearnerGroup(trainer, Path(run_dir) / "checkpoints", cfg.checkpoint_keep_last)
    real_checkpoint = group.checkpoint

    real_export = group.export
    failed: list[str] = []

    def once(what: str) -> None:
        if mode == what and not failed:
            failed.append(what)
            raise OSError(f"No space left on device (simulated {what} failure)")

    def checkpoint(client_state: dict[str, Any]) -> None:
        if client_state["next_index"] == fail_index + 1:
            once("ckpt")
        real_checkpoint(client_state)
        if mode == "die" and client_state["next_index"] == fail_index + 1:
            os._exit(9)

    def export(directory: Path) -> None:
        once("export")
        real_export(directory)

    group.checkpoint = checkpoint  # type: ignore[method-assign]
    group.export = export  # type: ignore[method-assign]
    bus = Bus(connect(redis_url))
    ctx = ServiceContext("learner", "learner-0", cfg, bus, StreamNames(run_id), asyncio.Event(), burst=True)
    service = LearnerService(cfg, ctx, trainer, group)
    real_publish = service.publisher.publish

    def publish(params: Any, version: int) -> Any:  # the WeightPublisher's signature
        if version == fail_index + 1:
            once("publish")
        return real_publish(params, version)

    service.publisher.publish = publish  # type: ignore[method-assign]
    try:
        await service.run()
    finally:
        await bus.redis.aclose()


if __name__ == "__main__":
    model, url, run, folder, index = sys.argv[1:6]
    mode, steps, every = sys.argv[6:9] + ["half", "3", "1"][len(sys.argv[6:9]) :]
    asyncio.run(life(model, url, run, folder, int(index), mode, int(steps), int(every)))
