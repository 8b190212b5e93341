"""A learner step that fails half-way is never retried in the same process (it would train part of
the batch twice): the learner stops with the error, the batch stays pending, a restart resumes from
the checkpoint; a batch that keeps failing that way is dead-lettered with its error."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis
from test_learner_group import training_batch

from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode, encode
from streamrl.common.config import ConsumerConfig
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import DeadLetter, TrainingBatch, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.learner.config import LearnerConfig
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.group import LearnerGroup
from streamrl.learner.service import LearnerService
from streamrl.learner.trainer import RLTrainer
from streamrl.rollout.tiny_model import build_tiny_qwen2

pytestmark = pytest.mark.slow


def _run_learner(cfg: LearnerConfig, redis_url: str, run_id: str, fail_index: int | None) -> None:
    """One learner life, in this process; batch ``fail_index`` fails after its first backward pass."""

    async def life() -> None:
        trainer = RLTrainer(cfg)
        real_step = trainer.step

        def step(batch: TrainingBatch) -> dict[str, Any]:
            if batch.index == fail_index:
                logp = trainer.policy(input_ids=__import__("torch").tensor([[5, 6, 7]])).logits
                trainer.policy.backward(logp.sum() * 0.0)
                raise RuntimeError("CUDA out of memory (simulated) in micro-batch 2")
            return real_step(batch)

        trainer.step = step  # type: ignore[method-assign]
        group = LearnerGroup(trainer, Path(cfg.run_dir) / "checkpoints", cfg.checkpoint_keep_last)
        bus = Bus(connect(redis_url))
        ctx = ServiceContext("learner", "learner-0", cfg, bus, StreamNames(run_id), asyncio.Event(), burst=True)
        try:
            await LearnerService(cfg, ctx, trainer, group).run()
        finally:
            await bus.redis.aclose()

    asyncio.run(life())


def test_a_step_failing_half_way_stops_the_learner_and_is_dead_lettered_when_it_keeps_failing(
    tmp_path: Path, redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ServiceContext, "mark_running", lambda self: None)  # no gc.freeze in the test process
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=64, vocab_size=384)
    cfg = LearnerConfig(
        model=str(model), run_id=run_id, run_dir=str(tmp_path / "run"), total_steps=3, checkpoint_every=1,
        ds=DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant", lr=1e-2),
        consumer=ConsumerConfig(max_deliveries=2, retry_delay_s=0.0),
    )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(3):
        client.xadd(names.batches, {"d": encode(training_batch(i))})

    for _ in range(2):  # fails half-way twice: each time the learner stops, the batch pending
        with pytest.raises(RuntimeError, match="batch-1: the step failed after training part of the batch"):
            _run_learner(cfg, redis_url, run_id, fail_index=1)
        assert client.xpending(names.batches, "learner")["pending"] == 1
        assert client.xlen(names.dead) == 0
    _run_learner(cfg, redis_url, run_id, fail_index=1)  # third life: batch 1 is dead-lettered, batch 2 trained

    (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
    assert "batch-1 failed mid-step 2 times: RuntimeError: CUDA out of memory (simulated)" in letter.error
    trained = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [w.batch_id for w in trained if w.metrics] == ["batch-0", "batch-2"]  # batch 1 never trained, nor twice
