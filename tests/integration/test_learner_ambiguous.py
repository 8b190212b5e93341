"""The learner under ambiguous faults (issue 26): whatever reaches it, it never wedges, never trains a
batch twice and never leaves a version unpublished.

* A re-sent copy of a batch (same index, same content) is skipped quietly; another batch with a taken
  index is dead-lettered naming both; a batch ahead of a missing index still in the stream (re-sent, or
  its delivery's reply lost) waits for it: that entry is trained first; a missing index that no entry
  will ever fill is recorded as lost (its version still published) and the run goes on.
* A learner whose checkpoint is behind the batches already acknowledged refuses to start, in one line.
* A batch that kills the learner mid-step is counted before the step, and skipped once it killed it
  ``consumer.max_deliveries`` times.
* A checkpoint, export or weight serving that fails after the step is finished on retry without
  training the batch again: its version is published exactly once and the run completes.

Real redis-server, the real learner service in burst mode (learner_failure_worker.py, one process per life).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from test_learner_failures import _life
from test_learner_group import training_batch

from streamrl.common.codec import decode, encode
from streamrl.common.messages import BATCH_SKIPPED, DeadLetter, TrainingBatch, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.torchkit.testing import build_tiny_qwen2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("ambiguous") / "model", hidden_size=64, vocab_size=384)


def _events(client: redis.Redis, names: StreamNames) -> list[tuple[int, str]]:  # type: ignore[type-arg]
    return [
        (w.version, w.batch_id) for w in (decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights))
    ]


def _letters(client: redis.Redis, names: StreamNames) -> list[DeadLetter]:  # type: ignore[type-arg]
    return [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]


def _feed(client: redis.Redis, names: StreamNames, *batches: TrainingBatch) -> None:  # type: ignore[type-arg]
    for batch in batches:
        client.xadd(names.batches, {"d": encode(batch)})


def test_a_resent_copy_of_a_batch_is_skipped_quietly(model: Path, tmp_path: Path, redis_url: str, run_id: str) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    _feed(client, names, training_batch(0), training_batch(0), training_batch(1), training_batch(2))
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _events(client, names) == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    assert _letters(client, names) == []  # a copy of what was trained: nothing lost, nothing to say
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_a_conflicting_batch_at_a_taken_index_is_dead_lettered_naming_both(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    other = training_batch(7)
    other.id, other.index = "batch-0b", 0
    _feed(client, names, training_batch(0), other, training_batch(1), training_batch(2))
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _events(client, names) == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    (letter,) = _letters(client, names)
    assert "batch-0b has index 0, which the learner already consumed as batch-0 with other content" in letter.error
    assert BATCH_SKIPPED not in letter.error  # batch-0b's samples were never the run's batch 0: nothing trained is lost
    assert "batch-0b has index 0, which the learner already consumed as batch-0" in done.stderr  # loud: ERROR
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_a_missing_index_is_recorded_as_lost_and_the_run_goes_on(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    """The issue's wedge: a re-sent publication left the stream with indices [0, 0] and the coordinator's
    counter at 2, so index 1 is never written. Batch 2 must not wait for it."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    _feed(client, names, training_batch(0), training_batch(0), training_batch(2), training_batch(3))
    client.set(names.state("batch_index"), 4)  # the coordinator went past index 1: no one will write it
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _events(client, names) == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2"), (4, "batch-3")]
    (letter,) = _letters(client, names)
    assert f"batch-1 (0 samples) {BATCH_SKIPPED}: index 1 never reached the learner" in letter.error
    assert decode(letter.payload, TrainingBatch).index == 1
    assert "never reached the learner" in done.stderr
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert events[2].metrics["learner/batches_skipped"] == 1.0  # version 2: unchanged weights
    assert "learner/loss/total" in events[3].metrics and "learner/loss/total" in events[4].metrics
    assert client.xpending(names.batches, "learner")["pending"] == 0
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert client.keys(names.state("learner_dead:*")) == []  # acknowledged: what was kept about them is gone
    assert client.keys(names.state("learner_failures:*")) == []
    assert int(client.hget(names.state("learner"), "acked")) == 4


def test_a_batch_ahead_of_a_predecessor_still_in_the_stream_trains_after_it(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    """Index 1 is in the stream after index 2 (a re-sent publication): 1 is taken from the stream and trained
    first, then 2; nothing is dead-lettered or recorded as lost, and the later delivery of 1 is a copy."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    _feed(client, names, training_batch(0), training_batch(2), training_batch(1))
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _events(client, names) == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    assert _letters(client, names) == []
    assert "batch index 1 is still in the stream" in done.stderr and "training it first" in done.stderr
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_a_batch_whose_delivery_reply_was_lost_is_trained_before_the_next(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    """The soak's loss: the reply of the XREADGROUP that delivered batch 1 was lost, so 1 sits pending under
    the learner, never handed to it, when batch 2 arrives. 2 must not be dead-lettered (its groups would be
    dropped): 1 trains first, then 2."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    _feed(client, names, training_batch(1), training_batch(0), training_batch(2))
    client.xgroup_create(names.batches, "learner", id="0")
    client.xreadgroup("learner", "learner", {names.batches: ">"}, count=1)  # 1 pending; its reader never saw it
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _events(client, names) == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    assert _letters(client, names) == []
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_a_checkpoint_behind_the_acknowledged_batches_refuses_to_start(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    _feed(client, names, *(training_batch(i) for i in range(3)))
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "4", "1")  # checkpoints at 1, 2, 3
    assert done.returncode == 0, done.stderr[-3000:]
    assert client.xpending(names.batches, "learner")["pending"] == 0  # all three acknowledged
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "latest").write_text("step_2")  # an operator restores the older checkpoint
    _feed(client, names, training_batch(3))
    done = _life(model, redis_url, run_id, tmp_path / "run", "-1", "half", "4", "1")
    assert done.returncode != 0
    assert (
        "the checkpoint at step 2 (next batch index 2) is behind the batches already acknowledged (up to index 2)"
        in done.stderr
    ), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert [v for v, _ in _events(client, names)] == [0, 1, 2, 3]  # nothing trained or published by it


def test_a_batch_that_kills_the_learner_is_skipped_once_it_killed_it_max_deliveries_times(
    model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    _feed(client, names, *(training_batch(i) for i in range(3)))
    for _ in range(2):  # max_deliveries = 2: two lives die in batch 1's step
        died = _life(model, redis_url, run_id, tmp_path / "run", "1", "kill")
        assert died.returncode == 9, died.stderr[-3000:]
        assert _letters(client, names) == []
    done = _life(model, redis_url, run_id, tmp_path / "run", "1", "kill")
    assert done.returncode == 0, done.stderr[-3000:]
    (letter,) = _letters(client, names)
    assert f"batch-1 (20 samples) {BATCH_SKIPPED}: it killed its consumer 2 times" in letter.error
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events if w.metrics] == [(1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    assert events[-2].metrics["learner/batches_skipped"] == 1.0
    assert client.xpending(names.batches, "learner")["pending"] == 0


@pytest.mark.parametrize("what", ["ckpt", "export", "publish"])
def test_a_failure_after_the_step_publishes_its_version_exactly_once(
    what: str, model: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    """Batch 2 (the last) trains; then its checkpoint, the final export or serving its weights fails once.
    The retry finishes what is left without training batch 2 again, and the run ends."""
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    _feed(client, names, *(training_batch(i) for i in range(3)))
    done = _life(model, redis_url, run_id, tmp_path / "run", "2", what)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated" in done.stderr  # it did fail once
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events] == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    assert "learner/loss/total" in events[3].metrics
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_3"
    assert client.xpending(names.batches, "learner")["pending"] == 0
