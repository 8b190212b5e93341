"""Lane 0's joiner with the run's weights key: it relays to the lanes only the learner's signed letters about a
joined batch, and signs what it relays, which the lanes' coordinators then believe (issue 38, finding 5)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from msgspec.structs import replace
from test_coordinator_lanes import Pair, lane_manifest, run_until, second_redis  # noqa: F401 - a fixture

from streamrl.common.codec import encode
from streamrl.common.messages import BATCH_SKIPPED, DeadLetter
from streamrl.common.weights.auth import sign
from streamrl.coordinator.dead_letters import LostBatch, what_was_lost


@pytest.fixture
def pair(redis_url: str, second_redis: str, run_id: str) -> Pair:  # noqa: F811 - the imported fixture
    return Pair(redis_url, second_redis, run_id)


def test_with_the_runs_key_only_the_learners_signed_letter_is_relayed_and_the_relays_are_signed(pair: Pair) -> None:
    """A forged letter about a joined batch (unsigned) is not relayed to any lane; the learner's, signed, is, and the
    lanes' coordinators believe the joiner's relays (signed for the run)."""
    key = b"the-run-key-0123456789"

    async def batch0(clients: list[aioredis.Redis]) -> None:
        for k, groups in ((0, ["p0", "p2"]), (1, ["p1"])):
            for ref in lane_manifest(pair.names[k], 0, groups).samples:
                await clients[k].set(ref.key, b"payload")
            await pair.publish(clients, k, lane_manifest(pair.names[k], 0, groups))

    run_until(pair, lambda: len(pair.home_batches()) >= 1, batch0, key=key)
    (joined,) = pair.home_batches()
    unsigned = DeadLetter(
        stream=pair.home_names.batches,
        entry_id="1-0",
        group="learner",
        consumer="l",
        error=f"batch-0 (3 samples) {BATCH_SKIPPED}: a payload is missing",
        deliveries=1,
        payload=encode(joined),
        ts=1.0,
    )
    pair.sync[0].xadd(pair.home_names.dead, {b"d": encode(unsigned)})
    marker = replace(unsigned, stream=pair.home_names.trajectories)  # read after it: the forged one was passed over
    pair.sync[0].xadd(pair.home_names.dead, {b"d": encode(marker)})

    async def nothing(clients: list[aioredis.Redis]) -> None:
        pass

    cursor = pair.home_names.state("joiner_dead_cursor")
    run_until(pair, lambda: bool(pair.sync[0].get(cursor)), nothing, key=key)
    about_batches = [[x for x in pair.letters(k) if x.stream == pair.names[k].batches] for k in (0, 1)]
    assert about_batches == [[], []], "a forged letter was relayed"  # (lane 0 is passed the marker: not a batch's)
    pair.sync[0].xadd(pair.home_names.dead, {b"d": encode(sign(unsigned, key, run_id=pair.home_names.run_id))})

    def relayed_to(k: int) -> list[DeadLetter]:
        return [x for x in pair.letters(k) if x.stream == pair.names[k].batches]

    run_until(pair, lambda: all(relayed_to(k) for k in (0, 1)), nothing, key=key)
    for k in (0, 1):
        (relayed,) = relayed_to(k)
        lost = what_was_lost(relayed, batches_stream=pair.names[k].batches, key=key, run_id=pair.home_names.run_id)
        assert isinstance(lost, LostBatch), lost
