"""Redis connection and the two atomic bus operations: publish, and commit (publish + ack).

Every write of a handler's outputs goes through :data:`COMMIT_LUA`, one server-side script that,
in a single atomic step, (1) marks the input as done under a de-duplication key, (2) writes the
outputs only if that mark is new, and (3) acknowledges the input entry. A redelivered entry whose
outputs were already written therefore produces no duplicate downstream (exactly-once effect).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from streamrl.common.codec import encode
from streamrl.common.messages import Message

PAYLOAD_FIELD = b"d"
"""Field of a stream entry that holds the msgpack payload."""


@dataclass(frozen=True)
class Output:
    """One thing a handler produces: a message appended to ``stream``, or stored in hash ``key``.

    Example:
        Output(stream=names.scored, message=scored)            # XADD
        Output(key=names.group_buffer(gid), field=tid, message=scored)   # HSET
    """

    message: Message
    stream: str | None = None
    key: str | None = None
    field: str | None = None

    def __post_init__(self) -> None:
        assert (self.stream is None) != (self.key is None), "an Output targets a stream or a hash key"
        assert self.key is None or self.field is not None, "a hash Output needs a field"


COMMIT_LUA = """
local fresh = 1
if KEYS[2] ~= '' then
  if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[3]) then fresh = 1 else fresh = 0 end
end
if fresh == 1 then
  local i = 5
  while i <= #ARGV do
    if ARGV[i] == 'x' then
      redis.call('XADD', ARGV[i + 1], 'MAXLEN', '~', ARGV[4], '*', 'd', ARGV[i + 3])
    else
      redis.call('HSET', ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
    end
    i = i + 4
  end
end
if ARGV[2] ~= '' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
end
return fresh
"""


def connect(url: str) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (``redis://`` or ``rediss://`` for TLS; password in the URL)."""
    return aioredis.Redis.from_url(url, decode_responses=False, health_check_interval=30)


class Bus:
    """Publishing side of the bus, bound to one Redis client."""

    def __init__(self, redis: aioredis.Redis, maxlen: int = 100_000) -> None:
        self.redis = redis
        self.maxlen = maxlen
        self._commit = redis.register_script(COMMIT_LUA)

    async def publish(self, stream: str, message: Message) -> str:
        """Append one message to a bounded stream; returns the entry id."""
        entry_id = await self.redis.xadd(stream, {PAYLOAD_FIELD: encode(message)}, maxlen=self.maxlen, approximate=True)
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def commit(
        self,
        outputs: Sequence[Output],
        *,
        ack_stream: str = "",
        ack_group: str = "",
        ack_entry: str = "",
        dedupe_key: str = "",
        dedupe_ttl_s: int = 7 * 24 * 3600,
    ) -> bool:
        """Atomically write ``outputs`` (unless ``dedupe_key`` is already set) and ack the input.

        Returns False when the outputs were skipped because the input was already handled.
        """
        keys, args = self.commit_args(
            outputs,
            ack_stream=ack_stream,
            ack_group=ack_group,
            ack_entry=ack_entry,
            dedupe_key=dedupe_key,
            dedupe_ttl_s=dedupe_ttl_s,
        )
        fresh = await self._commit(keys=keys, args=args)
        return bool(fresh)

    def commit_args(
        self,
        outputs: Sequence[Output],
        *,
        ack_stream: str,
        ack_group: str,
        ack_entry: str,
        dedupe_key: str,
        dedupe_ttl_s: int,
    ) -> tuple[list[str], list[str | bytes | int]]:
        """KEYS and ARGV of one commit (see :meth:`commit`), for batching several into one round trip."""
        args: list[str | bytes | int] = [ack_group, ack_entry, dedupe_ttl_s, self.maxlen]
        for out in outputs:
            payload = encode(out.message)
            if out.stream is not None:
                args += ["x", out.stream, "", payload]
            else:
                args += ["h", out.key or "", out.field or "", payload]
        return [ack_stream or "-", dedupe_key], args


class CommitBatcher:
    """Coalesces the commits of concurrently handled entries into one pipelined round trip.

    Each commit stays its own atomic script call; only the network round trips are shared.
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._pending: list[tuple[tuple[list[str], list[str | bytes | int]], asyncio.Future[bool]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def commit(self, outputs: Sequence[Output], **kwargs: Any) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((self.bus.commit_args(outputs, **kwargs), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                pipe = self.bus.redis.pipeline(transaction=False)
                for (keys, args), _ in batch:
                    await self.bus._commit(keys=keys, args=args, client=pipe)  # queues it in the pipeline
                results = await pipe.execute(raise_on_error=False)
            except Exception as e:  # noqa: BLE001 - the round trip failed: every waiter gets the error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(bool(result))
