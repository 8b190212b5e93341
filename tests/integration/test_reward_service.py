"""Reward replicas over a real redis-server: SIGKILL of one replica, failing scorers dead-lettered.

Runs the real entry point (``python -m streamrl.reward RECIPE``) as separate processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from streamrl.common.codec import decode
from streamrl.common.consumer import encode_payload
from streamrl.common.messages import DeadLetter, ScoredTrajectory, Tensor, Trajectory
from streamrl.common.streams import StreamNames

SLOW_REWARD = """
import time

def reward_func(queries, prompts, labels):
    time.sleep(0.25)
    return {"rewards": [float(len(q) - len(p)) for q, p in zip(queries, prompts)],
            "extra_logs": {"batch": len(queries)}}
"""


def trajectory(i: int) -> Trajectory:
    return Trajectory(
        id=f"g{i}/0",
        group_id=f"g{i}",
        group_index=0,
        group_size=1,
        prompt_ids=Tensor.from_list([1], "int32"),
        response_ids=Tensor.from_list([2], "int32"),
        logprobs=Tensor.from_list([-1.0], "float32"),
        loss_mask=Tensor.from_list([1], "uint8"),
        prompt_text="p: ",
        response_text="r" * (i % 5 + 1),
        traceparent=f"00-{i:032x}-{i:016x}-01",
    )


def write_recipe(
    tmp_path: Path,
    redis_url: str,
    run_id: str,
    scorer_toml: str,
    consumer_toml: str = "",
) -> Path:
    recipe = tmp_path / "reward.toml"
    recipe.write_text(
        f'run_id = "{run_id}"\nrun_dir = "{tmp_path / "run"}"\n[redis]\nurl = "{redis_url}"\n'
        f"[consumer]\nclaim_idle_ms = 1500\nclaim_interval_s = 0.2\nheartbeat_interval_s = 0.2\n"
        f"max_in_flight = 8\nretry_delay_s = 0.05\n{consumer_toml}\n"
        f"[reward]\nmax_batch_size = 4\nmax_wait_ms = 20\n[[reward.scorers]]\n{scorer_toml}\n"
    )
    return recipe


def start_replica(recipe: Path, instance: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"{instance}.log", "wb")
    cmd = [
        sys.executable,
        "-m",
        "streamrl.reward",
        str(recipe),
        f"--instance={instance}",
    ]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    return proc


def wait_for(
    predicate: Callable[[], bool],
    timeout_s: float,
    what: str,
    logs: Callable[[], str] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.05)


def scored(client: redis.Redis, names: StreamNames) -> list[ScoredTrajectory]:
    return [decode(f[b"d"], ScoredTrajectory) for _, f in client.xrange(names.scored)]


def dead_letters(client: redis.Redis, names: StreamNames) -> list[DeadLetter]:
    return [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]


def pending(client: redis.Redis, names: StreamNames) -> int:
    return int(client.xpending(names.trajectories, "reward")["pending"])


def test_sigkill_of_a_replica_loses_and_duplicates_nothing(tmp_path: Path, redis_url: str, run_id: str) -> None:
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    scorer = f'type = "function"\nname = "len"\npath = "{tmp_path / "slow_reward.py"}"'
    recipe = write_recipe(tmp_path, redis_url, run_id, scorer)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    num = 60
    for i in range(num):
        client.xadd(names.trajectories, encode_payload(trajectory(i)))
    victim = start_replica(recipe, "victim", tmp_path)
    survivor = start_replica(recipe, "survivor", tmp_path)
    try:
        wait_for(lambda: len(scored(client, names)) >= 8, 30, "the first scored trajectories")
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        wait_for(
            lambda: len(scored(client, names)) >= num and pending(client, names) == 0,
            60,
            "every trajectory",
        )
        time.sleep(0.5)  # a would-be duplicate would land now
        results = scored(client, names)
        assert sorted(s.trajectory.id for s in results) == sorted(f"g{i}/0" for i in range(num))
        for s in results:
            i = int(s.trajectory.id[1:].split("/")[0])
            assert s.reward == float(i % 5 + 1)
            assert s.score == s.reward  # a function without scores: the score is its reward
            assert s.extra["len/reward"] == s.reward and 1 <= s.extra["len/batch"] <= 4
            assert s.scorer == "len:function"
            assert s.traceparent == trajectory(i).traceparent
            assert s.reward_latency_ms >= 250
        assert client.xlen(names.dead) == 0, [d.error for d in dead_letters(client, names)]
    finally:
        victim.kill()
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(30) == 0, (tmp_path / "survivor.log").read_text()


def test_a_failing_scorer_dead_letters_with_the_reason(tmp_path: Path, redis_url: str, run_id: str) -> None:
    scorer = (
        'type = "http"\nname = "remote"\nurls = ["http://127.0.0.1:9/get_reward"]\n'
        "max_retries = 1\nbackoff_base_s = 0.01\nbackoff_max_s = 0.02\ntimeout_s = 1"
    )
    recipe = write_recipe(tmp_path, redis_url, run_id, scorer, consumer_toml="max_deliveries = 2")
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(3):
        client.xadd(names.trajectories, encode_payload(trajectory(i)))
    replica = start_replica(recipe, "r", tmp_path)
    try:
        wait_for(lambda: client.xlen(names.dead) >= 3, 30, "dead letters")
        letters = dead_letters(client, names)
        assert sorted(decode(d.payload, Trajectory).id for d in letters) == [
            "g0/0",
            "g1/0",
            "g2/0",
        ]
        for letter in letters:
            assert letter.deliveries == 2
            assert letter.error.startswith("ScorerError: http scorer 'remote'")
            assert "not scored after 2 attempts" in letter.error and "127.0.0.1:9" in letter.error
        assert client.xlen(names.scored) == 0  # never a silent 0 reward
        assert pending(client, names) == 0
    finally:
        replica.send_signal(signal.SIGTERM)
        assert replica.wait(30) == 0, (tmp_path / "r.log").read_text()


PID_REWARD = """
import os
import time

def reward_func(queries, prompts, labels):
    time.sleep(0.2)
    return {"rewards": [1.0] * len(queries), "extra_logs": {"pid": [float(os.getpid())] * len(queries)}}
"""


def test_a_replica_added_mid_run_takes_load_at_once(tmp_path: Path, redis_url: str, run_id: str) -> None:
    (tmp_path / "pid_reward.py").write_text(PID_REWARD)
    scorer = f'type = "function"\nname = "who"\npath = "{tmp_path / "pid_reward.py"}"'
    recipe = write_recipe(tmp_path, redis_url, run_id, scorer)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    num = 120
    for i in range(num):
        client.xadd(names.trajectories, encode_payload(trajectory(i)))
    first = start_replica(recipe, "first", tmp_path)
    second = None
    try:
        wait_for(lambda: len(scored(client, names)) >= 8, 60, "the first replica's output")
        second = start_replica(recipe, "second", tmp_path)
        wait_for(lambda: len(scored(client, names)) >= num and pending(client, names) == 0, 120, "every trajectory")
        results = scored(client, names)
        assert len(results) == num and len({s.trajectory.id for s in results}) == num
        by_pid: dict[float, int] = {}
        for s in results:
            by_pid[s.extra["who/pid"]] = by_pid.get(s.extra["who/pid"], 0) + 1
        assert set(by_pid) == {float(first.pid), float(second.pid)}
        assert by_pid[float(second.pid)] >= 0.2 * num, f"the added replica took too little: {by_pid}"
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
