"""The progress hash shows every non-zero run counter (in a real Redis)."""

from __future__ import annotations

from streamrl.coordinator import state as st
from streamrl.coordinator.progress import Progress
from streamrl.coordinator.state import RunState


def test_non_zero_counters_reach_the_progress_hash(in_redis) -> None:  # type: ignore[no-untyped-def]
    async def scenario(state: RunState) -> dict[bytes, bytes]:
        await state.redis.incrby(state.key(st.GROUPS_TIMED_OUT), 2)
        await state.redis.incr(state.key(st.BATCHES_DEAD))
        await state.redis.incr(state.key(st.DEAD_LETTERS))
        progress = Progress(state)
        progress.update({"step": 3})
        await progress.refresh_counters()
        await progress.publish(version=3)
        return await state.redis.hgetall(state.key(st.PROGRESS))  # type: ignore[no-any-return]

    shown = {k.decode(): v.decode() for k, v in in_redis(scenario).items()}
    assert shown == {"step": "3", "version": "3", "groups_timed_out": "2", "batches_dead": "1", "dead": "1"}
