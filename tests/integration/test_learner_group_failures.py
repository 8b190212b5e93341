"""A 2-rank learner group (gloo on CPU) whose follower rank fails in one batch's step, over a real Redis.

* An out-of-memory error (or bad data) on the follower alone, before any backward pass: every rank
  raises together, rank 0 counts the failure with the follower's error and retries; at
  ``max_deliveries`` the batch is skipped (dead letter, version published) and the run goes on.
  (Before: the follower died, the group was killed before rank 0 counted anything: a crash loop.)
* The follower killed mid-step: the group exits non-zero at once, the attempt already counted in
  Redis, so the next life skips the batch once it killed the group ``max_deliveries`` times.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from test_learner_group import ENV, build_tiny_qwen2, feed, recipe

from streamrl.common.codec import decode
from streamrl.common.messages import BATCH_SKIPPED, DeadLetter, WeightsPublished
from streamrl.common.streams import StreamNames

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("learner_group_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model test_learner_group trains (built once for this module)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("group") / "model", hidden_size=64, vocab_size=384)


def _group_life(path: Path, mode: str, timeout: float = 300) -> tuple[int, str, float]:
    """One life of the group (rank 1 fails in batch 1): exit code, output, seconds."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(WORKER), str(path), "--burst"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**ENV, "FAIL_RANK": "1", "FAIL_INDEX": "1", "FAIL_MODE": mode},
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def _recipe(tmp_path: Path, model: Path, redis_url: str, run_id: str, max_deliveries: int) -> Path:
    path = recipe(tmp_path / "r.toml", model, redis_url, run_id, ranks=2)
    path.write_text(
        path.read_text()
        .replace("total_steps = 6", "total_steps = 3")
        .replace("checkpoint_every = 3", "checkpoint_every = 1")
        .replace(
            "heartbeat_interval_s = 0.5",
            f"heartbeat_interval_s = 0.5\nmax_deliveries = {max_deliveries}\nretry_delay_s = 0.0",
        )
    )
    return path


def test_an_error_on_a_follower_rank_fails_the_step_on_every_rank_and_rank_0_counts_it(
    tmp_path: Path,
    model_dir: Path,
    redis_url: str,
    run_id: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    feed(client, names, range(3))
    code, out, _ = _group_life(_recipe(tmp_path, model_dir, redis_url, run_id, max_deliveries=2), "raise")
    assert code == 0, out[-6000:]
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events] == [(0, ""), (1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    assert events[2].metrics["learner/batches_skipped"] == 1.0
    (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
    assert (
        f"batch-1 (20 samples) {BATCH_SKIPPED}: its step failed 2 times, last: RuntimeError: CUDA out of memory "
        "(simulated) in batch 1 (rank 1)" in letter.error
    )
    assert client.xpending(names.batches, "learner")["pending"] == 0


def test_a_follower_rank_killed_mid_step_stops_the_group_at_once_with_the_attempt_counted(
    tmp_path: Path,
    model_dir: Path,
    redis_url: str,
    run_id: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    feed(client, names, range(3))
    path = _recipe(tmp_path, model_dir, redis_url, run_id, max_deliveries=1)
    code, out, _ = _group_life(path, "kill")
    assert code == 9, out[-6000:]
    assert "rank 1 exited with code 9; stopping the group" in out
    attempts = client.hgetall(names.state("learner_failures:batch-1"))
    assert attempts[b"started"] == b"1" and b"finished" not in attempts  # counted before the step, never ended
    code, out, _ = _group_life(path, "kill")  # the next life: batch 1 killed the group once = max_deliveries
    assert code == 0, out[-6000:]
    (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
    assert f"batch-1 (20 samples) {BATCH_SKIPPED}: it killed its consumer 1 times" in letter.error
    events = [decode(f[b"d"], WeightsPublished) for _, f in client.xrange(names.weights)]
    assert [(w.version, w.batch_id) for w in events if w.metrics] == [(1, "batch-0"), (2, "batch-1"), (3, "batch-2")]
    assert client.xpending(names.batches, "learner")["pending"] == 0
