"""An entry whose handling fails *outside* its handler (here: its dead letter cannot be written) stops the
consumer loop loudly - the error logged with the entry, the process exiting non-zero for its supervisor to
restart - instead of the task's exception being dropped and the entry taken later for "a lost reply".
Real redis-server, a real worker process (tests/integration/bus_worker.py)."""

from __future__ import annotations

import redis
from test_bus import make_trajectory, pending, start_worker

from streamrl.common.consumer import encode_payload
from streamrl.common.streams import StreamNames


def test_a_dead_letter_that_cannot_be_written_stops_the_loop_with_the_cause(redis_url: str, run_id: str) -> None:
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    client.set(names.dead, "not a stream")  # every XADD to the dead-letter stream fails (WRONGTYPE)
    client.xadd(names.trajectories, encode_payload(make_trajectory(0)))
    worker = start_worker(
        redis_url,
        run_id,
        "w",
        '--echo.fail_ids=["g0/0"]',
        "--consumer.max_deliveries=1",
        "--consumer.claim_idle_ms=600",
    )
    try:
        code = worker.wait(timeout=60)  # before the fix: runs for ever, the entry re-queued as an orphan
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log = worker.log_path.read_text()  # type: ignore[attr-defined]
    assert code != 0, log
    assert "handling failed outside the handler; stopping" in log and "WRONGTYPE" in log, log
    assert "never received (a lost reply)" not in log
    assert pending(client, names) == 1  # kept for the next life of the consumer
