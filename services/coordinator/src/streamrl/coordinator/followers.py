"""The coordinator's tails of the ``weights`` and ``dead`` streams, each resumed from a cursor in Redis.

Both are broadcast streams the coordinator must see whole and in order (no consumer group shares
them out), so each is read with the shared :class:`~streamrl.common.follower.StreamFollower`: an
undecodable entry, or a weights event not signed with the run's key, is logged and passed over
without stopping the tail. The cursor is saved after each read's entries are handled: a restarted
coordinator handles the last read again (at-least-once), so the handlers are idempotent (each gets the
entry id with the message).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from streamrl.common.bus import PAYLOAD_FIELD
from streamrl.common.codec import decode
from streamrl.common.follower import StreamFollower
from streamrl.common.lanes import home_run_id
from streamrl.common.messages import Message, WeightsPublished
from streamrl.common.replies import text
from streamrl.common.weights.auth import check
from streamrl.coordinator.state import RunState

BLOCK_MS = 200
"""Longest wait of one read: the tail notices ``stop`` this often."""


async def follow(
    state: RunState,
    stream: str,
    cursor_name: str,
    handle: Callable[[str, Any], Awaitable[None]],
    stop: asyncio.Event,
    *,
    weights_key: bytes | None,
) -> None:
    """Hand every entry of ``stream`` to ``handle``, from the cursor kept in ``state:{cursor_name}``."""
    cursor = text(await state.redis.get(state.key(cursor_name)) or b"0-0")

    def decode_entry(fields: dict[bytes, bytes]) -> Any:
        msg: Message = decode(fields.get(PAYLOAD_FIELD, b""))
        if isinstance(msg, WeightsPublished):
            # a forged version must not move the run; the learner signs for the run, a lane's copy too
            check(msg, weights_key, run_id=home_run_id(state.names.run_id))
        return msg

    async def each(entries: list[tuple[str, Any]], last_id: str) -> str:
        for entry_id, msg in entries:
            await handle(entry_id, msg)
        await state.tx().set(state.key(cursor_name), last_id).execute()
        return last_id

    await StreamFollower(state.redis, stream, decode_entry, each, block_ms=BLOCK_MS).run(cursor, stop)
