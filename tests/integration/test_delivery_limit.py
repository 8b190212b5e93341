"""An entry that kills the process handling it (OOM kill, segfault, SIGKILL) is dead-lettered once it
was delivered ``max_deliveries`` times - counted from the PEL before its handler runs again - and the
other entries are handled. Real redis-server, real worker processes restarted as a supervisor would."""

from __future__ import annotations

import time

import redis
from test_bus import make_trajectory, pending, scored_ids, start_worker

from streamrl.common.codec import decode
from streamrl.common.consumer import encode_payload
from streamrl.common.messages import DeadLetter
from streamrl.common.streams import StreamNames


def test_an_entry_that_kills_its_consumer_is_dead_lettered_after_max_deliveries(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    for i in range(6):
        client.xadd(names.trajectories, encode_payload(make_trajectory(i)))
    restarts, deadline = 0, time.monotonic() + 90
    # a supervisor restarting the crashed worker under its name (the launcher, a container runtime)
    while not (client.xlen(names.dead) and pending(client, names) == 0 and len(scored_ids(client, names)) == 5):
        assert restarts <= 6, (
            f"still crash-looping after {restarts} restarts: {client.xlen(names.dead)} dead letters, "
            f"{pending(client, names)} pending"
        )
        assert time.monotonic() < deadline, "timed out"
        worker = start_worker(
            redis_url, run_id, "w", '--echo.crash_ids=["g2/0"]', "--consumer.max_deliveries=3", "--burst"
        )
        code = worker.wait(timeout=60)
        restarts += code != 0
    assert restarts == 3, f"killed {restarts} times"  # deliveries 1-3 crashed, the 4th was dead-lettered unhandled
    (letter,) = [decode(f[b"d"], DeadLetter) for _, f in client.xrange(names.dead)]
    assert letter.error.startswith("killed its consumer 3 times") and letter.deliveries == 4
    assert decode(letter.payload).id == "g2/0"  # type: ignore[attr-defined]
    assert sorted(scored_ids(client, names)) == [f"g{i}/0" for i in (0, 1, 3, 4, 5)]


def test_keep_alive_counts_no_delivery(redis_url: str, run_id: str) -> None:
    """A live consumer's slow entry stays at one delivery however often it is kept alive."""
    names = StreamNames(run_id)
    client = redis.Redis.from_url(redis_url)
    client.xadd(names.trajectories, encode_payload(make_trajectory(0)))
    client.xgroup_create(names.trajectories, "reward", id="0")
    worker = start_worker(redis_url, run_id, "slow", "--echo.delay_s=3", "--consumer.claim_idle_ms=300")
    try:
        deadline = time.monotonic() + 30
        while not client.xpending_range(names.trajectories, "reward", min="-", max="+", count=1):
            assert time.monotonic() < deadline, "never read"
            time.sleep(0.05)
        time.sleep(2)  # ~20 keep-alive rounds (every claim_idle_ms / 3)
        (held,) = client.xpending_range(names.trajectories, "reward", min="-", max="+", count=1)
        assert held["times_delivered"] == 1 and held["time_since_delivered"] < 300
    finally:
        worker.terminate()
        worker.wait(timeout=30)
