"""A learner step that fails half-way is never retried in the same process (it would train part of
the batch twice): the learner stops with the error, the batch stays pending, a restart resumes from
the checkpoint; a batch that keeps failing that way is dead-lettered with its error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from test_learner_group import training_batch

from streamrl.common.codec import decode, encode
from streamrl.common.messages import DeadLetter, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.rollout.tiny_model import build_tiny_qwen2

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("learner_failure_worker.py")


def _life(model: Path, redis_url: str, run_id: str, run_dir: Path) -> subprocess.CompletedProcess[str]:
    """One learner life; batch 1 fails after its first backward pass."""
    return subprocess.run(
        [sys.executable, str(WORKER), str(model), redis_url, run_id, str(run_dir), "1"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_step_failing_half_way_stops_the_learner_and_is_dead_lettered_when_it_keeps_failing(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=64, vocab_size=384)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(3):
        client.xadd(names.batches, {"d": encode(training_batch(i))})

    for _ in range(2):  # fails half-way twice: each time the learner stops, the batch pending
        done = _life(model, redis_url, run_id, tmp_path / "run")
        assert done.returncode != 0
        assert "batch-1: the step failed after training part of the batch" in done.stderr, done.stderr[-3000:]
        assert client.xpending(names.batches, "learner")["pending"] == 1
        assert client.xlen(names.dead) == 0
    done = _life(model, redis_url, run_id, tmp_path / "run")  # third life: batch 1 dead-lettered, batch 2 trained
    assert done.returncode == 0, done.stderr[-3000:]

    (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
    assert "batch-1 failed mid-step 2 times: RuntimeError: CUDA out of memory (simulated)" in letter.error
    trained = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [w.batch_id for w in trained if w.metrics] == ["batch-0", "batch-2"]  # batch 1 never trained, nor twice
