"""How the learner treats batches it cannot train, in order, once.

* A step that fails half-way is never retried in the same process (it would train part of the batch
  twice): the learner stops with the error, the batch stays pending, a restart resumes from the
  checkpoint. A batch that keeps failing (half-way or before any backward pass) is skipped: dead-lettered
  with its error, its version still published, so the run goes on.
* A batch from the future is dead-lettered while the index it skips is still to come, never trained
  out of order; a copy of a trained batch is skipped quietly (test_learner_ambiguous.py has the rest).
* A learner resumed from a checkpoint older than its last published version never republishes a version.
* A learner killed between a checkpoint and its version's commit publishes that version on restart,
  naming its batch and with its step's metrics: the batch is trained once and never forgotten.
"""

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
from streamrl.common.weights.auth import KEY_ENV, check_letter
from streamrl.torchkit.testing import build_tiny_qwen2

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("learner_failure_worker.py")
RUN_KEY = b"the-run-key-0123456789"


DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What an in-process test's ``init_distributed`` leaves in this process's environment: a worker that
inherited it would rendezvous on this process's port (EADDRINUSE) instead of taking a free one."""


def _own_process_group_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in DIST_ENV}


def _life(
    model: Path, redis_url: str, run_id: str, run_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """One learner life; by default batch 1 fails after its first backward pass."""
    return subprocess.run(
        [sys.executable, str(WORKER), str(model), redis_url, run_id, str(run_dir), *(args or ("1",))],
        env={**_own_process_group_env(), "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


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
    assert (
        "batch-1 (20 samples) skipped untrained: its step failed 2 times, last: RuntimeError: CUDA out of memory"
        in letter.error
    )
    assert decode(letter.payload).index == 1  # the coordinator counts its samples from the letter
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    trained = [w.batch_id for w in events if w.metrics and "learner/batches_skipped" not in w.metrics]
    assert trained == ["batch-0", "batch-2"]  # batch 1 never trained, nor twice
    # batch 1's version is still published (same weights), so version = batches consumed; none reused
    assert [w.version for w in events] == [0, 1, 1, 1, 2, 3]  # each restart re-serves the checkpointed version
    assert [w.version for w in events if w.metrics] == [1, 2, 3]
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_a_batch_failing_before_any_backward_pass_is_skipped_and_the_run_goes_on(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=64, vocab_size=384)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(3):
        client.xadd(names.batches, {"d": encode(training_batch(i))})
    done = _life(model, redis_url, run_id, tmp_path / "run", "1", "before", env={KEY_ENV: RUN_KEY.decode()})
    assert done.returncode == 0, done.stderr[-3000:]
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [w.version for w in events] == [0, 1, 2, 3]
    assert events[2].metrics["learner/batches_skipped"] == 1.0 and events[2].batch_id == "batch-1"
    (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
    assert (
        "batch-1 (20 samples) skipped untrained: its step failed 2 times, last: ValueError: a bad input" in letter.error
    )
    check_letter(letter, RUN_KEY, run_id=run_id)  # signed: the coordinator believes it (a forged one it does not)
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_batches_from_the_future_or_the_past_are_dead_lettered_and_never_trained_out_of_order(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=64, vocab_size=384)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in (0, 1000, 1, 0, 2):  # a batch from the future, and a second copy of batch 0
        client.xadd(names.batches, {"d": encode(training_batch(i))})
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", env={KEY_ENV: RUN_KEY.decode()})
    assert done.returncode == 0, done.stderr[-3000:]
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events] == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    (future,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]  # the copy of 0: skipped quietly
    # batches 1 and 2, still in the stream behind it, are trained first; then 1000 is a batch from the future
    assert "batch-1000 is ahead of the learner, whose next batch is 3" in future.error
    assert "a batch from the future, never trained out of order" in future.error
    check_letter(future, RUN_KEY, run_id=run_id)  # the consumer loop's letter is signed too
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_a_resumed_learner_republishes_only_its_last_version(tmp_path: Path, redis_url: str, run_id: str) -> None:
    """Resumed from a checkpoint older than its last published version, the learner retrains the
    batches in between; it publishes their versions again only for the last one (whose weights died
    with it if no worker fetched them), with the retrained weights."""
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=64, vocab_size=384)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(4):
        client.xadd(names.batches, {"d": encode(training_batch(i))})
    # life 1: checkpoint at step 2; batch 2 trained and version 3 published; batch 3 fails half-way
    done = _life(model, redis_url, run_id, tmp_path / "run", "3", "half", "4", "2")
    assert done.returncode != 0
    assert [decode(f[b"d"], WeightsPublished).version for _, f in client.xrange(names.weights)] == [0, 1, 2, 3]
    # life 2 resumes at step 2: batch 2 is trained again and version 3 published again, then batch 3
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "4", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "versions up to 3 were published before the restart" in done.stderr
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events] == [
        (0, ""),
        (1, "batch-0"),
        (2, "batch-1"),
        (3, "batch-2"),
        (3, "batch-2"),
        (4, "batch-3"),
    ]
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_a_learner_killed_between_checkpoint_and_publish_publishes_that_step_on_restart(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=64, vocab_size=384)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(4):
        client.xadd(names.batches, {"d": encode(training_batch(i))})
    # life 1: batch 1's step (2) is checkpointed, then the process dies before version 2 is committed
    died = _life(model, redis_url, run_id, tmp_path / "run", "1", "die", "4", "2")
    assert died.returncode == 9, died.stderr[-3000:]
    assert [decode(f[b"d"], WeightsPublished).version for _, f in client.xrange(names.weights)] == [0, 1]
    # life 2 resumes at step 2: version 2 is published for batch 1 (not trained again), then 3 and 4
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "4", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "version 2 was checkpointed but not published before the restart" in done.stderr
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events] == [
        (0, ""),
        (1, "batch-0"),
        (2, "batch-1"),
        (3, "batch-2"),
        (4, "batch-3"),
    ]
    assert "learner/loss/total" in events[2].metrics and "learner/staleness_max" in events[2].metrics
    assert client.xpending(names.batches, "learner")["pending"] == 0
