"""Redis connection and the two atomic bus operations: publish, and commit (publish + ack).

Every write of a handler's outputs goes through :data:`COMMIT_LUA`, one server-side script that,
for each input handled, (1) marks the input as done under a de-duplication key, (2) writes the
outputs only if that mark is new, and (3) acknowledges the input entry. A redelivered entry whose
outputs were already written therefore produces no duplicate downstream (exactly-once effect).
One script call carries the commits of every entry that finished at about the same time
(:class:`CommitBatcher`): ~17 us of client CPU per commit instead of ~32 as one call each, and a
fraction of the server's time. A commit whose write fails (say, a key of the wrong type) removes
its de-duplication mark and leaves its entry unacknowledged, so a retry writes its outputs again;
the other commits of the call are not affected.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamrl.common.codec import encode
from streamrl.common.errors import MessageTooLargeError
from streamrl.common.messages import Message

logger = logging.getLogger(__name__)
T = TypeVar("T")
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
local replies = {}
local p = 2
for c = 1, tonumber(ARGV[1]) do
  local stream, group, entry, dedupe = ARGV[p], ARGV[p + 1], ARGV[p + 2], ARGV[p + 3]
  local ttl, maxlen, outputs = ARGV[p + 4], ARGV[p + 5], tonumber(ARGV[p + 6])
  p = p + 7
  local fresh = 1
  if dedupe ~= '' and not redis.call('SET', dedupe, '1', 'NX', 'EX', ttl) then fresh = 0 end
  local failed = nil
  for o = 1, outputs do
    if fresh == 1 and not failed then
      local r
      if ARGV[p] == 'x' then
        r = redis.pcall('XADD', ARGV[p + 1], 'MAXLEN', '~', maxlen, '*', 'd', ARGV[p + 3])
      else
        r = redis.pcall('HSET', ARGV[p + 1], ARGV[p + 2], ARGV[p + 3])
      end
      if type(r) == 'table' and r.err then failed = r.err end
    end
    p = p + 4
  end
  if failed then
    if dedupe ~= '' then redis.call('DEL', dedupe) end
    replies[c] = 'ERR ' .. failed
  else
    if entry ~= '' then redis.call('XACK', stream, group, entry) end
    replies[c] = fresh
  end
end
return replies
"""
"""ARGV: the number of commits, then per commit ``stream group entry dedupe_key ttl maxlen n_outputs``
and 4 values per output (``x stream - payload`` or ``h key field payload``). Reply per commit: 1
(written), 0 (a duplicate: skipped, acknowledged) or an error string (nothing acknowledged).
KEYS: every key the call touches (:func:`commit_keys`), declared as Redis Cluster requires; they
share the run's hash tag (:mod:`streamrl.common.streams`), so one call stays on one slot."""
MAX_COMMITS_PER_CALL = 256
"""Commits in one script call (the server runs a call without interruption)."""


RECONNECT_BACKOFF_CAP_S = 2.0


class RedisLoginError(RedisError):
    """Redis refused the user or password (never retried: waiting does not fix a wrong password)."""


class OutageRetry(Retry):
    """Redis commands retried through a connection outage (a restart, a failover), with backoff.

    Every command that meets a connection error, a timeout or a server still loading its data
    reconnects and tries again, backing off up to 2 s between tries, for about ``outage_s`` seconds;
    then the error reaches the caller. One WARNING line when an outage starts and one INFO line when
    Redis answers again, however many commands were waiting (the state is shared by the process).
    """

    _down_since: float | None = None

    def __init__(self, outage_s: float) -> None:
        tries = max(1, math.ceil(outage_s / RECONNECT_BACKOFF_CAP_S))
        errors = (RedisConnectionError, RedisTimeoutError, BusyLoadingError)
        super().__init__(ExponentialBackoff(cap=RECONNECT_BACKOFF_CAP_S, base=0.05), tries, errors)
        self.outage_s = outage_s

    async def call_with_retry(
        self, do: Callable[[], Awaitable[T]], fail: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> T:
        failed_here = False

        async def noted_fail(error: Exception, *rest: Any) -> Any:
            nonlocal failed_here
            failed_here = True
            if OutageRetry._down_since is None:
                OutageRetry._down_since = time.monotonic()
                logger.warning("redis unreachable (%s); retrying for up to %.0f s", _one_line(error), self.outage_s)
            return await fail(error, *rest)

        async def once() -> T:
            try:
                return await do()
            except AuthenticationError as e:  # a wrong password is not an outage: say so at once
                raise RedisLoginError(
                    f"redis refused the login ({_one_line(e)}): check the user and password in redis.url"
                ) from None

        result = await super().call_with_retry(once, noted_fail, *args, **kwargs)
        if failed_here and OutageRetry._down_since is not None:  # a command that went through the outage
            logger.info("redis is back after %.1f s", time.monotonic() - OutageRetry._down_since)
            OutageRetry._down_since = None
        return result


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


def connect(url: str, *, outage_s: float = 60.0, max_connections: int = 256) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (``redis://`` or ``rediss://`` for TLS; password in the URL).

    It rides out an outage of up to ``outage_s`` seconds (:class:`OutageRetry`), and at most
    ``max_connections`` connections are open at once: a command that finds them all busy waits for
    one (never "Too many connections", however many entries a consumer retries at once).
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, decode_responses=False, health_check_interval=30,
        retry=OutageRetry(outage_s),
    )  # fmt: skip
    return aioredis.Redis(connection_pool=pool)


class Bus:
    """Publishing side of the bus, bound to one Redis client."""

    def __init__(self, redis: aioredis.Redis, maxlen: int = 100_000, max_message_bytes: int = 32 * 2**20) -> None:
        self.redis = redis
        self.maxlen = maxlen
        self.max_message_bytes = max_message_bytes
        self._commit = redis.register_script(COMMIT_LUA)

    def encode(self, message: Message, stream: str) -> bytes:
        """``message`` encoded for ``stream``; :class:`MessageTooLargeError` over ``max_message_bytes``."""
        payload = encode(message)
        if len(payload) > self.max_message_bytes:
            raise MessageTooLargeError(
                f"a {type(message).__name__} of {len(payload) / 2**20:.1f} MiB for {stream} is over the "
                f"{self.max_message_bytes / 2**20:.1f} MiB limit (redis.max_message_mb)"
            )
        return payload

    async def publish(self, stream: str, message: Message) -> str:
        """Append one message to a bounded stream; returns the entry id."""
        payload = self.encode(message, stream)
        entry_id = await self.redis.xadd(stream, {PAYLOAD_FIELD: payload}, maxlen=self.maxlen, approximate=True)
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
        args = self.commit_args(
            outputs,
            ack_stream=ack_stream,
            ack_group=ack_group,
            ack_entry=ack_entry,
            dedupe_key=dedupe_key,
            dedupe_ttl_s=dedupe_ttl_s,
        )
        (reply,) = await self._commit(keys=commit_keys([args]), args=[1, *args])
        return _fresh(reply)

    def commit_args(
        self,
        outputs: Sequence[Output],
        *,
        ack_stream: str,
        ack_group: str,
        ack_entry: str,
        dedupe_key: str,
        dedupe_ttl_s: int,
    ) -> list[str | bytes | int]:
        """The ARGV of one commit (see :data:`COMMIT_LUA`), to be sent alone or with others."""
        args: list[str | bytes | int] = [ack_stream, ack_group, ack_entry, dedupe_key, dedupe_ttl_s, self.maxlen, len(outputs)]  # fmt: skip
        for out in outputs:
            payload = self.encode(out.message, out.stream or out.key or "")
            if out.stream is not None:
                args += ["x", out.stream, "", payload]
            else:
                args += ["h", out.key or "", out.field or "", payload]
        return args


def commit_keys(commits: Sequence[Sequence[str | bytes | int]]) -> list[str]:
    """The keys a call of :data:`COMMIT_LUA` touches, from the ARGV of each of its commits: the acked
    stream, the de-dup key and every output's stream or hash (each once, in order)."""
    keys: dict[str, None] = {}
    for args in commits:
        stream, _, _, dedupe = (str(a) for a in args[:4])
        keys.update({k: None for k in (stream, dedupe) if k})
        for o in range(int(args[6])):
            keys[str(args[8 + 4 * o])] = None
    return list(keys)


def _fresh(reply: Any) -> bool:
    """One commit's reply: True (written) / False (a duplicate), or the write error raised."""
    if isinstance(reply, bytes | str):
        raise ResponseError(reply.decode() if isinstance(reply, bytes) else reply)
    return bool(reply)


class CommitBatcher:
    """Sends the commits of concurrently handled entries together: one script call per batch.

    Each commit keeps its own outcome (written, duplicate, or its own error).
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._pending: list[tuple[list[str | bytes | int], asyncio.Future[bool]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def commit(self, outputs: Sequence[Output], **kwargs: Any) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((self.bus.commit_args(outputs, **kwargs), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_COMMITS_PER_CALL], self._pending[MAX_COMMITS_PER_CALL:]
            args: list[str | bytes | int] = [len(batch)]
            for commit_args, _ in batch:
                args += commit_args
            try:
                replies = await self.bus._commit(keys=commit_keys([a for a, _ in batch]), args=args)
            except Exception as e:  # noqa: BLE001 - the call failed as a whole: every waiter gets the error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, future), reply in zip(batch, replies, strict=True):
                if future.done():
                    continue
                try:
                    future.set_result(_fresh(reply))
                except ResponseError as e:
                    future.set_exception(e)
