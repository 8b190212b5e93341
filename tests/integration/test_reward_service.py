"""Reward replicas over a real redis-server: SIGKILL of one replica, failing scorers dead-lettered, permanent
errors (a refused token, a service that cannot be reached) pausing intake, and a remote reward service (reward_server.py) failing a whole batch at the demo's in-flight settings.

Runs the real entry point (``python -m streamrl.reward RECIPE``) as separate processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from reward_server import ServerProcess

from streamrl.common.codec import decode
from streamrl.common.consumer import encode_payload
from streamrl.common.health import live_heartbeats
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


def start_replica(
    recipe: Path, instance: str, tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
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
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
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
            # the reward span's: a child in the trajectory's trace (g0's all-zero trace id is none: a new one)
            assert s.traceparent != trajectory(i).traceparent
            assert i == 0 or s.traceparent[3:35] == trajectory(i).traceparent[3:35]
            assert s.reward_latency_ms >= 250
        assert client.xlen(names.dead) == 0, [d.error for d in dead_letters(client, names)]
    finally:
        victim.kill()
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(30) == 0, (tmp_path / "survivor.log").read_text()


def test_a_scorer_that_cannot_connect_pauses_intake_instead_of_dead_lettering(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    """A remote reward service that refuses connections past the retries: the worker pauses (heartbeat ``paused``
    with the reason, said once), dead-letters nothing and holds what it read pending. Before: every entry was
    dead-lettered after max_deliveries and its group replaced, burning the dataset."""
    scorer = (
        'type = "http"\nname = "remote"\nurls = ["http://127.0.0.1:9/get_reward"]\n'
        "max_retries = 1\nbackoff_base_s = 0.01\nbackoff_max_s = 0.02\ntimeout_s = 1"
    )
    recipe = write_recipe(tmp_path, redis_url, run_id, scorer, consumer_toml="max_deliveries = 2")
    recipe.write_text(recipe.read_text().replace("max_wait_ms = 20\n", "max_wait_ms = 20\nprobe_interval_s = 0.2\n"))
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for i in range(3):
        client.xadd(names.trajectories, encode_payload(trajectory(i)))
    replica = start_replica(recipe, "r", tmp_path)
    log = tmp_path / "r.log"
    try:

        def paused() -> bool:
            return any(b.status == "paused" for b in live_heartbeats(client, names, "reward"))

        wait_for(paused, 30, "the worker to pause", log.read_text)
        (beat,) = live_heartbeats(client, names, "reward")
        assert beat.reason.startswith("http scorer 'remote': 3 samples not scored after 2 attempts"), beat.reason
        assert "connection refused (is the service up?)" in beat.reason
        time.sleep(1.5)  # several probes, and a claim_idle_ms: the entries stay held, never charged a delivery
        assert client.xlen(names.dead) == 0 and client.xlen(names.scored) == 0  # never a silent 0 reward
        assert pending(client, names) == 3
        assert log.read_text().count("reward scoring PAUSED") == 1
    finally:
        replica.send_signal(signal.SIGTERM)
        assert replica.wait(30) == 0, log.read_text()
    assert pending(client, names) == 3  # left for the next worker


PID_REWARD = """
import os
import time

def reward_func(queries, prompts, labels):
    time.sleep(0.5)  # the first replica alone needs ~10 s for all: the second, started under load, still finds work
    return {"rewards": [1.0] * len(queries), "extra_logs": {"pid": [float(os.getpid())] * len(queries)}}
"""


def test_a_replica_added_mid_run_takes_load_at_once(tmp_path: Path, redis_url: str, run_id: str) -> None:
    (tmp_path / "pid_reward.py").write_text(PID_REWARD)
    scorer = f'type = "function"\nname = "who"\npath = "{tmp_path / "pid_reward.py"}"'
    recipe = write_recipe(tmp_path, redis_url, run_id, scorer)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    num = 160
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


# --- A remote reward service failing a whole batch, at the demo's in-flight settings -------------
#
# recipes/demo.toml reads 256 entries at a time with 512 in flight, in micro-batches of up to 256.
# The HTTP scorer's times are scaled down about tenfold from the defaults so each test takes
# seconds: a fault lasts 3 s (the finding's outage was 30 s), a request retries for up to
# retry_timeout_s = 6 s (default 60 s) with backoff from 0.05 s capped at 1 s (defaults 0.5 s and
# 10 s), max_retries = 20 as by default. The logic is the same: the fault is shorter than a
# request's retry window, so it is ridden out.

TOKEN = "t0ken-for-tests"
NUM_IN_FLIGHT = 512
FAULT_S = 3.0


SCALED_RETRIES = {"timeout_s": 5, "retry_timeout_s": 6, "max_retries": 20, "backoff_base_s": 0.05, "backoff_max_s": 1}


def write_demo_recipe(
    tmp_path: Path, redis_url: str, run_id: str, url: str, consumer: str = "", **scorer: float
) -> Path:
    recipe = tmp_path / "reward-demo.toml"
    knobs = "".join(f"{k} = {v}\n" for k, v in {**SCALED_RETRIES, **scorer}.items())
    recipe.write_text(
        f'run_id = "{run_id}"\nrun_dir = "{tmp_path / "run"}"\n[redis]\nurl = "{redis_url}"\n'
        "[consumer]\ncount = 256\nmax_in_flight = 512\n"  # recipes/demo.toml
        f"claim_interval_s = 0.5\nheartbeat_interval_s = 0.5\n{consumer}\n"
        "[reward]\nmax_batch_size = 256\nmax_wait_ms = 5\n"  # recipes/demo.toml
        f'[[reward.scorers]]\ntype = "http"\nname = "remote"\nurls = ["{url}"]\ntoken_env = "RM_TOKEN"\n'
        f"{knobs}"
    )
    return recipe


@pytest.fixture
def remote() -> Iterator[ServerProcess]:
    server = ServerProcess(token=TOKEN)
    server.start()
    yield server
    server.kill()


def start_and_wait_running(
    recipe: Path, tmp_path: Path, client: redis.Redis, names: StreamNames, token: str = TOKEN
) -> subprocess.Popen[bytes]:
    proc = start_replica(recipe, "r", tmp_path, env={"RM_TOKEN": token})

    def running() -> bool:
        assert proc.poll() is None, (tmp_path / "r.log").read_text()
        return any(b.status == "running" for b in live_heartbeats(client, names, "reward"))

    wait_for(
        running,
        30,
        "the reward service to start",
        lambda: (tmp_path / "r.log").read_text(),
    )
    return proc


def publish(client: redis.Redis, names: StreamNames, num: int) -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(num):
        pipe.xadd(names.trajectories, encode_payload(trajectory(i)))
    pipe.execute()


def wait_all_accounted(
    client: redis.Redis, names: StreamNames, num: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 25
) -> tuple[list[ScoredTrajectory], list[DeadLetter]]:
    """Every entry scored or dead-lettered (once), none pending, the service alive and heartbeating."""

    def done() -> bool:
        assert proc.poll() is None, f"the reward service exited ({proc.returncode})\n{log.read_text()[-3000:]}"
        return client.xlen(names.scored) + client.xlen(names.dead) >= num and pending(client, names) == 0

    wait_for(done, timeout_s, "every entry scored or dead-lettered", lambda: log.read_text()[-3000:])
    time.sleep(0.3)  # a late duplicate would land now
    results, letters = scored(client, names), dead_letters(client, names)
    ids = [s.trajectory.id for s in results] + [decode(d.payload, Trajectory).id for d in letters]
    assert sorted(ids) == sorted(trajectory(i).id for i in range(num))  # each once
    assert pending(client, names) == 0
    assert proc.poll() is None
    (beat,) = live_heartbeats(client, names, "reward")
    assert beat.status == "running" and time.time() - beat.ts < 2.0  # the heartbeat task is alive
    return results, letters


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log.read_text()[-3000:]


def assert_one_line_reasons(letters: list[DeadLetter]) -> set[str]:
    """Dead-letter reasons are short single lines, without class reprs or byte-string ids."""
    reasons = {d.error for d in letters}
    for reason in reasons:
        assert "\n" not in reason and "<class" not in reason and "b'" not in reason, reason
        assert len(reason) < 400, reason
    return reasons


@pytest.mark.parametrize("fault", ["500", "drop"])
def test_remote_failing_a_while_at_demo_in_flight_is_ridden_out(
    tmp_path: Path, redis_url: str, run_id: str, remote: ServerProcess, fault: str
) -> None:
    """HTTP 500s (or dropped connections) for 3 s while 512 entries are in flight: every entry is
    scored, none dead-lettered, nothing pending, the service alive. Before: 501 of 512 were
    dead-lettered by an 8 s burst of 500s (3 retries of at most 3.5 s, then 3 quick deliveries)."""
    client, names = redis.Redis.from_url(redis_url), StreamNames(run_id)
    recipe = write_demo_recipe(tmp_path, redis_url, run_id, remote.url)
    proc = start_and_wait_running(recipe, tmp_path, client, names)
    try:
        remote.control(fault, for_s=FAULT_S)
        publish(client, names, NUM_IN_FLIGHT)
        results, letters = wait_all_accounted(client, names, NUM_IN_FLIGHT, proc, tmp_path / "r.log")
        assert not letters, assert_one_line_reasons(letters)
        assert remote.stats()[f"fault_{fault}"] >= 16  # the whole first round of requests failed
        retried = [s for s in results if s.extra["reward/retried"] == 1.0]
        assert len(retried) >= 256 and all(s.extra["reward/attempts"] >= 2 for s in retried)
        assert all(s.extra["remote/reward"] == s.reward for s in results)
    finally:
        stop(proc, tmp_path / "r.log")
    log = (tmp_path / "r.log").read_text()
    assert log.count("is failing") == 1 and log.count("answers again") == 1, log[-3000:]


def test_remote_down_then_back_at_demo_in_flight_is_ridden_out(
    tmp_path: Path, redis_url: str, run_id: str, remote: ServerProcess
) -> None:
    """The remote service killed (connections refused) while 512 entries arrive, back on the same port
    3 s later (the finding: 30 s): every entry scored, nothing dead-lettered or pending, the service
    alive. Before: 450 of 512 were dead-lettered by a 6 s outage."""
    client, names = redis.Redis.from_url(redis_url), StreamNames(run_id)
    recipe = write_demo_recipe(tmp_path, redis_url, run_id, remote.url)
    proc = start_and_wait_running(recipe, tmp_path, client, names)
    try:
        remote.kill()
        publish(client, names, NUM_IN_FLIGHT)
        time.sleep(FAULT_S)
        remote.start()
        results, letters = wait_all_accounted(client, names, NUM_IN_FLIGHT, proc, tmp_path / "r.log")
        assert not letters, assert_one_line_reasons(letters)
        assert all(s.extra["reward/retried"] == 1.0 for s in results)  # none got through while it was down
    finally:
        stop(proc, tmp_path / "r.log")
    log = (tmp_path / "r.log").read_text()
    assert "is failing: connection refused (is the service up?)" in log and log.count("answers again") == 1


def test_wrong_token_at_demo_in_flight_pauses_naming_the_variable_and_loses_nothing(
    tmp_path: Path, redis_url: str, run_id: str, remote: ServerProcess
) -> None:
    """A refused token is not retried: the worker pauses at once with one reason that names $RM_TOKEN (its
    heartbeat says so), dead-letters none of its 512 entries and calls the server only to probe; a worker
    restarted with the right token scores them all. Before: all 512 were dead-lettered within seconds."""
    client, names = redis.Redis.from_url(redis_url), StreamNames(run_id)
    recipe = write_demo_recipe(tmp_path, redis_url, run_id, remote.url, consumer="retry_delay_s = 0.2")
    recipe.write_text(recipe.read_text().replace("max_wait_ms = 5\n", "max_wait_ms = 5\nprobe_interval_s = 0.5\n"))
    proc = start_and_wait_running(recipe, tmp_path, client, names, token="wrong")
    log = tmp_path / "r.log"
    try:
        publish(client, names, NUM_IN_FLIGHT)

        def paused() -> bool:
            return any(b.status == "paused" for b in live_heartbeats(client, names, "reward"))

        wait_for(paused, 10, "the worker to pause", lambda: log.read_text()[-3000:])
        (beat,) = live_heartbeats(client, names, "reward")
        assert beat.reason.split(" (http://")[0] + beat.reason.split(")", 1)[1] == (
            "http scorer 'remote': HTTP 403, not retried: the server refused the token in $RM_TOKEN (token_env): "
            "give the server the token the reward service holds (scoring resumes by itself), or restart the service "
            'with the right one in $RM_TOKEN; server said: {"error": "invalid token"}'
        )
        time.sleep(2.0)  # four probes
        assert client.xlen(names.dead) == 0 and client.xlen(names.scored) == 0
        assert pending(client, names) == NUM_IN_FLIGHT
        # one request per 32 samples of the batches that met it, then one per probe: no retry storm
        assert remote.stats()["forbidden"] <= NUM_IN_FLIGHT // 32 + 8, remote.stats()
        assert log.read_text().count("reward scoring PAUSED") == 1
    finally:
        stop(proc, log)
    fixed = start_and_wait_running(recipe, tmp_path, client, names, token=TOKEN)
    try:
        results, letters = wait_all_accounted(client, names, NUM_IN_FLIGHT, fixed, log, timeout_s=60)
        assert len(results) == NUM_IN_FLIGHT and not letters
    finally:
        stop(fixed, log)


def test_remote_failing_past_the_retry_window_dead_letters_with_a_one_line_reason(
    tmp_path: Path, redis_url: str, run_id: str, remote: ServerProcess
) -> None:
    """500s for longer than retry_timeout_s x max_deliveries: every entry dead-lettered with one short
    line (attempts, time, URL, the server's flattened body), nothing pending, the service alive.
    Before: the reason carried the server's multi-line body as it came."""
    client, names = redis.Redis.from_url(redis_url), StreamNames(run_id)
    recipe = write_demo_recipe(
        tmp_path,
        redis_url,
        run_id,
        remote.url,
        consumer="max_deliveries = 2\nretry_delay_s = 0.2",
        retry_timeout_s=0.5,
        backoff_max_s=0.2,
    )
    remote.control("500")
    proc = start_and_wait_running(recipe, tmp_path, client, names)
    try:
        publish(client, names, NUM_IN_FLIGHT)
        results, letters = wait_all_accounted(client, names, NUM_IN_FLIGHT, proc, tmp_path / "r.log")
        assert not results and len(letters) == NUM_IN_FLIGHT
        for reason in assert_one_line_reasons(letters):
            assert reason.startswith("ScorerError: http scorer 'remote': ") and " samples not scored after " in reason
            assert reason.endswith(
                f"to {remote.url}; last error: HTTP 500: injected internal error Traceback (most recent call last): ..."
            )
    finally:
        stop(proc, tmp_path / "r.log")


def test_sigterm_while_the_remote_is_down_leaves_entries_pending_for_the_next_replica(
    tmp_path: Path, redis_url: str, run_id: str, remote: ServerProcess
) -> None:
    """Stopped while its 512 entries wait for a remote service that is down: the replica exits 0 after
    its grace period with every entry still pending (none dead-lettered, no "MicroBatcher is closed"),
    and a replica started once the service is back scores them all."""
    client, names = redis.Redis.from_url(redis_url), StreamNames(run_id)
    recipe = write_demo_recipe(
        tmp_path, redis_url, run_id, remote.url, consumer="shutdown_grace_s = 0.5\nclaim_idle_ms = 500"
    )
    first = start_and_wait_running(recipe, tmp_path, client, names)
    remote.kill()
    publish(client, names, NUM_IN_FLIGHT)
    wait_for(lambda: pending(client, names) == NUM_IN_FLIGHT, 10, "every entry read")
    time.sleep(0.5)
    stop(first, tmp_path / "r.log")
    assert client.xlen(names.dead) == 0, assert_one_line_reasons(dead_letters(client, names))
    assert pending(client, names) == NUM_IN_FLIGHT and client.xlen(names.scored) == 0
    remote.start()
    second = start_replica(recipe, "s", tmp_path, env={"RM_TOKEN": TOKEN})
    try:
        results, letters = wait_all_accounted(client, names, NUM_IN_FLIGHT, second, tmp_path / "s.log")
        assert len(results) == NUM_IN_FLIGHT and not letters
    finally:
        stop(second, tmp_path / "s.log")
