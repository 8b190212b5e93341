"""A synchronous reward function that never returns on some inputs: those samples are dead-lettered
with the reason and every other sample is scored; a worker whose threads are all held by such calls
exits non-zero (its orchestrator restarts it) instead of heartbeating while it scores nothing.

The real entry point (``python -m streamrl.reward RECIPE``) against a real redis-server.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import msgspec
import redis
from test_reward_service import dead_letters, pending, scored, start_replica, trajectory, wait_for, write_recipe

from streamrl.common.codec import decode
from streamrl.common.consumer import encode_payload
from streamrl.common.messages import Trajectory
from streamrl.common.streams import StreamNames

HANGING_REWARD = """
import threading

def reward_func(queries, prompts, labels):
    if any("hang" in q for q in queries):
        threading.Event().wait()  # for ever
    return {"rewards": [1.0] * len(queries)}
"""


def _fill(client: redis.Redis, names: StreamNames, num_good: int, hung: list[int]) -> None:
    for i in range(num_good + len(hung)):
        t = trajectory(i)
        if i in hung:
            t = msgspec.structs.replace(t, response_text="hang")
        client.xadd(names.trajectories, encode_payload(t))


def _recipe(tmp_path: Path, redis_url: str, run_id: str, threads: int) -> Path:
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    scorer = (
        f'type = "function"\nname = "h"\npath = "{tmp_path / "hanging_reward.py"}"\n'
        f"timeout_s = 0.5\nmax_threads = {threads}"
    )
    return write_recipe(tmp_path, redis_url, run_id, scorer, consumer_toml="max_deliveries = 3")


def test_hung_samples_are_dead_lettered_and_the_others_scored(tmp_path: Path, redis_url: str, run_id: str) -> None:
    recipe = _recipe(tmp_path, redis_url, run_id, threads=8)
    client, names = redis.Redis.from_url(redis_url), StreamNames(run_id)
    hung = [3, 11, 17]
    _fill(client, names, 30, hung)
    replica = start_replica(recipe, "r", tmp_path)
    log = tmp_path / "r.log"
    try:
        wait_for(
            lambda: len(scored(client, names)) >= 30 and client.xlen(names.dead) >= 3 and pending(client, names) == 0,
            60,
            "every good sample scored and the hung ones dead-lettered",
            log.read_text,
        )
        assert sorted(s.trajectory.id for s in scored(client, names)) == sorted(
            f"g{i}/0" for i in range(33) if i not in hung
        )
        letters = dead_letters(client, names)
        assert sorted(decode(d.payload, Trajectory).id for d in letters) == ["g11/0", "g17/0", "g3/0"]
        for letter in letters:
            assert letter.deliveries == 3
            assert "reward function" in letter.error and "(scorer 'h')" in letter.error, letter.error
            assert "timed out after 0.5 s" in letter.error or "still running" in letter.error, letter.error
        assert replica.poll() is None, "the worker kept scoring with threads to spare"
    finally:
        replica.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = replica.wait(30)  # hung threads do not keep the process from exiting
    assert code == 0, log.read_text()
    assert time.monotonic() - started < 20


def test_a_worker_whose_threads_all_hang_exits_non_zero(tmp_path: Path, redis_url: str, run_id: str) -> None:
    recipe = _recipe(tmp_path, redis_url, run_id, threads=2)
    client, names = redis.Redis.from_url(redis_url), StreamNames(run_id)
    _fill(client, names, 12, hung=[0, 1, 2])
    replica = start_replica(recipe, "r", tmp_path)
    log = tmp_path / "r.log"
    try:
        code = replica.wait(40)
    finally:
        replica.kill()
    text = log.read_text()
    assert code == 1, text
    assert "every one of its 2 threads is held by a call that timed out" in text, text
    # nothing lost: what was not scored or dead-lettered as hung stays pending for the restarted worker
    letters = dead_letters(client, names)
    assert all("timed out" in d.error or "still running" in d.error for d in letters), [d.error for d in letters]
    assert len(scored(client, names)) + len(letters) + pending(client, names) == 15
