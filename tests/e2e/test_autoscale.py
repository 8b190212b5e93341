"""Autoscaling on backlog through ``streamrl up``: real reward replicas (a scorer with 0.1 s latency)
on a real Redis (the test's: it writes trajectories as the rollout would, which the embedded Redis's logins
keep to the rollout). A burst of trajectories adds replicas within the up cooldown; once it is
drained, replicas are removed one per down cooldown while a trickle keeps arriving, and every
trajectory is scored exactly once: nothing lost, nothing twice, nothing dead-lettered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from streamrl.common.codec import decode
from streamrl.common.consumer import encode_payload
from streamrl.common.health import live_heartbeats
from streamrl.common.messages import ScoredTrajectory, Tensor, Trajectory
from streamrl.common.streams import StreamNames
from streamrl.ops.scaling import desired_replicas

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
RUN_ID = "autoscale"
BURST = 400

RECIPE = """
run_id = "{run_id}"
run_dir = "{run_dir}"

[redis]
url = "{redis_url}"

[up]
services = ["reward"]
until = "coordinator"   # not started here: the run goes on until the test stops it
grace_s = 30
reconcile_interval_s = 0.5

[autoscale]
enabled = true
interval_s = 0.5
services = {{ reward = {{ min_replicas = 1, max_replicas = 3, target_backlog = 40, scale_up_cooldown_s = 1.0, scale_down_cooldown_s = 4.0 }} }}

[consumer]
heartbeat_interval_s = 0.5
claim_interval_s = 1.0
max_in_flight = 8
count = 8

[reward]
max_batch_size = 8
max_wait_ms = 5

[[reward.scorers]]
name = "slow"
type = "function"
path = "{scorer}"
"""


def _trajectory(i: int) -> Trajectory:
    return Trajectory(
        id=f"g{i}/0",
        group_id=f"g{i}",
        group_index=0,
        group_size=1,
        prompt_ids=Tensor.from_list([1, 2], "int32"),
        response_ids=Tensor.from_list([3, 4, 5], "int32"),
        logprobs=Tensor.from_list([-0.5, -0.5, -0.5], "float32"),
        loss_mask=Tensor.from_list([1, 1, 1], "uint8"),
        prompt_text="Q: ",
        response_text=f"answer {i}",
    )


def test_a_burst_adds_reward_replicas_and_draining_it_removes_them_losing_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    recipe = tmp_path / "autoscale.toml"
    recipe.write_text(
        RECIPE.format(run_id=RUN_ID, run_dir=tmp_path / "run", scorer=HERE / "slow_reward.py", redis_url=redis_url)
    )
    log = tmp_path / "up.log"
    env = {**os.environ, "STREAMRL_REDIS__RETAIN_CONSUMED_S": "86400", "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:  # the child keeps its own descriptor; ours is closed at once
        up = subprocess.Popen(
            [sys.executable, "-m", "streamrl.ops.cli", "up", str(recipe)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    names = StreamNames(RUN_ID)
    sent = 0
    try:
        client = redis.Redis.from_url(redis_url)

        def live() -> int:
            return sum(1 for b in live_heartbeats(client, names, "reward") if b.status == "running")

        def wait(predicate, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
            started = time.monotonic()
            while not predicate():
                assert up.poll() is None, f"streamrl up exited:\n{log.read_text()[-4000:]}"
                assert time.monotonic() - started < timeout_s, (
                    f"timed out waiting for {what}:\n{log.read_text()[-4000:]}"
                )
                time.sleep(0.1)
            return time.monotonic() - started

        wait(lambda: live() == 1, 120, "the first reward replica")
        pipe = client.pipeline(transaction=False)
        for i in range(BURST):
            pipe.xadd(names.trajectories, encode_payload(_trajectory(i)))
        pipe.execute()
        sent = BURST
        # 400 waiting at 40 per replica asks for the maximum: 3 replicas, decided within one look
        # (interval_s) after the up cooldown, then started
        decided = wait(lambda: desired_replicas(client, names).get("reward") == 3, 10, "the scale-up decision")
        assert decided < 1.0 + 0.5 + 1.0, f"the scale-up was decided {decided:.1f} s after the burst"
        wait(lambda: live() == 3, 60, "three replicas")
        peak = 3
        # a trickle keeps arriving while the backlog drains and replicas are removed (draining ones
        # hold entries in flight when they get SIGTERM)
        down_started = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            client.xadd(names.trajectories, encode_payload(_trajectory(sent)))
            sent += 1
            now_live = live()
            peak = max(peak, now_live)
            if now_live < 3 and down_started is None:
                down_started = time.monotonic()
            if now_live == 1 and down_started is not None:
                break
            time.sleep(0.1)
        assert live() == 1, f"replicas were not removed back to 1:\n{log.read_text()[-4000:]}"
        assert peak == 3
        wait(lambda: client.xlen(names.scored) >= sent, 60, "every trajectory scored")
        time.sleep(1.0)  # anything scored twice would show up now
        scored = [decode(f[b"d"], ScoredTrajectory).trajectory.id for _, f in client.xrange(names.scored)]
        assert sorted(scored) == sorted(f"g{i}/0" for i in range(sent)), "lost or duplicated"
        assert client.xlen(names.dead) == 0
        assert client.xpending(names.trajectories, "reward")["pending"] == 0
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(90)
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert "autoscale reward: 1 -> 3 replicas" in text
    assert "autoscale reward: 2 -> 1 replicas" in text
