"""Redis connection and the bus's atomic writes: commit (a consumer's outputs + ack), and transactions.

Every write of a handler's outputs goes through :data:`COMMIT_LUA`, one server-side script that, for
each input entry handled, (1) checks that the entry is **still pending** in its group (XPENDING on
its id), (2) writes the outputs only if it is, and (3) acknowledges it. Once an entry is acked - by
this commit's first execution, or by another consumer that handled a reclaimed copy - a re-sent or
late commit for it writes nothing and reports a duplicate: exactly-once effect downstream without a
de-duplication key per message. A commit that acknowledges no entry carries a random operation id
(a ``once`` key with a TTL of twice ``redis.outage_s``, as :mod:`streamrl.common.tx` does), so the
client re-sending it after a lost reply cannot write it twice. With ``ack=False`` (the learner acks
its batches later) the entry is checked but left pending.

One script call carries the commits of every entry that finished at about the same time
(:class:`CommitBatcher`): ~17 us of client CPU per commit instead of ~32 as one call each. A commit
whose write fails (say, a key of the wrong type) leaves its entry unacknowledged, so a retry writes its
outputs again; the other commits of the call are not affected.

**Fencing**: ``Bus.fence`` (a :class:`Fence`, set by :mod:`streamrl.common.lifecycle` once the
service holds its lease) is checked inside every commit and transaction script: when the lease key
holds another process's token the call writes nothing and raises
:class:`~streamrl.common.lease.LeaseLostError` naming the holder; a key with no value lets it go on.

**Transactions**: :meth:`Bus.tx` (:mod:`streamrl.common.tx`) for every other write with an effect
(batch publication, counters, state): atomic, fenced, preconditions, idempotent against a re-send.
A plain ``redis.incr/xadd/...`` or ``pipeline().execute()`` re-sent after a lost reply runs twice.

**Outages and a full Redis**: :class:`OutageRetry` retries a command through a connection outage and
through ``OOM command not allowed`` (maxmemory reached with ``noeviction``: the command did not run),
for about ``redis.outage_s``. The scripts are flagged (``#!lua``), so a full Redis refuses them whole.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    OutOfMemoryError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamrl.common.aio import wait_set
from streamrl.common.codec import PAYLOAD_FIELD as PAYLOAD_FIELD
from streamrl.common.codec import encode
from streamrl.common.errors import MessageTooLargeError
from streamrl.common.messages import Message
from streamrl.common.tx import TX_LUA, Tx, fenced_error, once_key
from streamrl.common.tx import Fence as Fence
from streamrl.common.tx import PreconditionFailed as PreconditionFailed

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Output:
    """One thing a handler produces: a message appended to ``stream``, or stored in hash ``key``; or (no
    message) a payload key made permanent (``op="persist"``: the commit fails, writing nothing more, when the
    key is gone), deleted (``op="delete"``) or given ``ttl_ms`` to live (``op="expire"``: kept for replay and
    debugging, ``redis.payload_retention_s``). Persist outputs go first: they are checked before the writes.

    Example:
        Output(stream=names.scored, message=scored)            # XADD
        Output(key=names.group_buffer(gid), field=tid, message=scored)   # HSET
        Output(key=record.payload_key, op="persist")          # PERSIST (the payload this commit references)
    """

    message: Message | None = None
    stream: str | None = None
    key: str | None = None
    field: str | None = None
    op: str = "write"
    """``write`` (XADD / HSET of ``message``), ``persist``, ``delete`` or ``expire`` (of ``key``)."""
    ttl_ms: int = 0
    """``expire``: the key's time to live (ms, > 0)."""

    def __post_init__(self) -> None:
        assert (self.stream is None) != (self.key is None), "an Output targets a stream or a hash key"
        if self.op == "write":
            assert self.message is not None, "a write Output needs a message"
            assert self.key is None or self.field is not None, "a hash Output needs a field"
        else:
            assert self.op in ("persist", "delete", "expire") and self.key is not None and self.message is None, (
                f"a {self.op} Output names a key and no message"
            )
            assert (self.op == "expire") == (self.ttl_ms > 0), "an expire Output (and only it) has a ttl_ms"


COMMIT_LUA = """#!lua
local fence_key, fence_token = ARGV[2], ARGV[3]
if fence_key ~= '' then
  local holder = redis.call('GET', fence_key)
  if holder and holder ~= fence_token then return redis.error_reply('FENCED ' .. holder) end
end
local replies = {}
local p = 4
for c = 1, tonumber(ARGV[1]) do
  local stream, group, entry, ack, once = ARGV[p], ARGV[p + 1], ARGV[p + 2], ARGV[p + 3], ARGV[p + 4]
  local ttl_ms, maxlen, outputs = ARGV[p + 5], ARGV[p + 6], tonumber(ARGV[p + 7])
  p = p + 8
  local fresh, failed = 1, nil
  if entry ~= '' then
    local held = redis.pcall('XPENDING', stream, group, entry, entry, 1)
    if type(held) == 'table' and held.err then failed = held.err elseif #held == 0 then fresh = 0 end
  elseif once ~= '' and not redis.call('SET', once, '1', 'NX', 'PX', ttl_ms) then
    fresh = 0
  end
  for o = 1, outputs do
    if fresh == 1 and not failed then
      local r
      if ARGV[p] == 'x' then
        r = redis.pcall('XADD', ARGV[p + 1], 'MAXLEN', '~', maxlen, '*', 'd', ARGV[p + 3])
      elseif ARGV[p] == 'p' then
        r = redis.pcall('PERSIST', ARGV[p + 1])
        if r == 0 and redis.call('EXISTS', ARGV[p + 1]) == 0 then r = {err = 'payload missing: ' .. ARGV[p + 1]} end
      elseif ARGV[p] == 'd' then
        r = redis.pcall('UNLINK', ARGV[p + 1])
      elseif ARGV[p] == 'e' then
        r = redis.pcall('PEXPIRE', ARGV[p + 1], ARGV[p + 2])
      else
        r = redis.pcall('HSET', ARGV[p + 1], ARGV[p + 2], ARGV[p + 3])
      end
      if type(r) == 'table' and r.err then failed = r.err end
    end
    p = p + 4
  end
  if failed then
    if once ~= '' then redis.call('DEL', once) end
    replies[c] = 'ERR ' .. failed
  else
    if fresh == 1 and entry ~= '' and ack == '1' then redis.call('XACK', stream, group, entry) end
    replies[c] = fresh
  end
end
return replies
"""
"""ARGV: the number of commits, the fence key and token ('' for none), then per commit
``stream group entry ack(1/0) once_key ttl_ms maxlen n_outputs`` and 4 values per output
(``x stream - payload``, ``h key field payload``, ``p key - -`` PERSIST - an error when the key is gone -
or ``d key - -`` UNLINK, or ``e key ttl_ms -`` PEXPIRE). A commit with an ``entry`` writes only while that
entry is pending in ``group``; one without uses its ``once_key``. Reply per commit: 1 (written), 0 (a
duplicate: the entry was acked already, or the once key exists; nothing written) or an error string
(nothing acknowledged); the error ``FENCED holder`` for the whole call when the fence holds another
token. KEYS: every key the call touches (:func:`commit_keys`), declared as Redis Cluster requires;
they share the run's hash tag (:mod:`streamrl.common.streams`), so one call stays on one slot."""
MAX_COMMITS_PER_CALL = 256
"""Commits in one script call (the server runs a call without interruption); their bytes are capped too
(``redis.max_command_mb``, :func:`take_commits`)."""


def commit_bytes(args: Sequence[str | bytes | int]) -> int:
    """The bulk bytes of one commit's ARGV (payloads and names; an int counts as its digits)."""
    return sum(len(a) if isinstance(a, bytes | str) else len(str(a)) for a in args)


def take_commits(sizes: Sequence[int], max_bytes: int, max_count: int = MAX_COMMITS_PER_CALL) -> int:
    """How many of the waiting commits (``sizes``: bytes of each, in order) go into the next call: at most
    ``max_count``, adding up to at most ``max_bytes`` - but always at least one (a commit bigger than the
    budget goes alone; its outputs are bounded by ``redis.max_message_mb`` each)."""
    total = 0
    for n, size in enumerate(sizes[:max_count]):
        if n and total + size > max_bytes:
            return n
        total += size
    return min(len(sizes), max_count)


RECONNECT_BACKOFF_CAP_S = 2.0


OUTAGE_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ClusterDownError,
    TryAgainError,
    OutOfMemoryError,
)
"""What :class:`OutageRetry` retries through (and raises once the outage outlasts it)."""


class RedisLoginError(RedisError):
    """Redis refused the user or password (never retried: waiting does not fix a wrong password)."""


class OutageRetry(Retry):
    """Redis commands retried through a connection outage (a restart, a failover) or a full Redis, with backoff.

    Every command that meets a connection error, a timeout, a server still loading its data, a Redis Cluster
    down or moving the key's slot (``CLUSTERDOWN`` - a node just restarted -, ``TRYAGAIN``), or
    ``OOM command not allowed`` (``maxmemory`` reached under ``noeviction``: the command did not run, so
    trying again is safe) reconnects and tries again, backing off up to 2 s between tries, for about
    ``outage_s`` seconds (``math.inf``: until it answers); then the error reaches the caller. One WARNING
    line when an outage (or a full Redis) starts and one INFO line when Redis answers (accepts writes)
    again, however many commands were waiting (the state is shared by the process): :meth:`healthy_for`
    says since when.
    """

    _down_since: float | None = None
    _full_since: float | None = None
    _healthy_since: float = float("-inf")
    """When the last outage (or full Redis) ended (monotonic); -inf: none seen by this process."""

    def __init__(self, outage_s: float) -> None:
        tries = -1 if math.isinf(outage_s) else max(1, math.ceil(outage_s / RECONNECT_BACKOFF_CAP_S))  # -1: forever
        super().__init__(ExponentialBackoff(cap=RECONNECT_BACKOFF_CAP_S, base=0.05), tries, OUTAGE_ERRORS)
        self.outage_s = outage_s

    def _for_how_long(self) -> str:
        return "until it answers" if math.isinf(self.outage_s) else f"for up to {self.outage_s:.0f} s"

    @classmethod
    def healthy_for(cls, now: float | None = None) -> float:
        """Seconds since this process last saw Redis come back from an outage (inf: none seen; 0: down now)."""
        if cls._down_since is not None or cls._full_since is not None:
            return 0.0
        return (time.monotonic() if now is None else now) - cls._healthy_since

    async def call_with_retry(
        self, do: Callable[[], Awaitable[T]], fail: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> T:
        failed_here = False

        async def noted_fail(error: Exception, *rest: Any) -> Any:
            nonlocal failed_here
            failed_here = True
            if isinstance(error, OutOfMemoryError):
                if OutageRetry._full_since is None:
                    OutageRetry._full_since = time.monotonic()
                    logger.warning(
                        "redis is full (maxmemory reached: %s); retrying %s", _one_line(error), self._for_how_long()
                    )
            elif OutageRetry._down_since is None:
                OutageRetry._down_since = time.monotonic()
                logger.warning("redis unreachable (%s); retrying %s", _one_line(error), self._for_how_long())
            return await fail(error, *rest)

        async def once() -> T:
            try:
                return await do()
            except AuthenticationError as e:  # a wrong password is not an outage: say so at once
                raise RedisLoginError(
                    f"redis refused the login ({_one_line(e)}): check the user and password in redis.url"
                ) from None

        result = await super().call_with_retry(once, noted_fail, *args, **kwargs)
        if failed_here:  # a command that went through the outage
            now = time.monotonic()
            if OutageRetry._down_since is not None:
                logger.info("redis is back after %.1f s", now - OutageRetry._down_since)
                OutageRetry._down_since = None
                OutageRetry._healthy_since = now
            if OutageRetry._full_since is not None:  # no heartbeat was written meanwhile either
                logger.info("redis accepts writes again after %.1f s (it was full)", now - OutageRetry._full_since)
                OutageRetry._full_since = None
                OutageRetry._healthy_since = now
        return result


async def outlast(what: str, run: Callable[[], Awaitable[None]], stop: asyncio.Event, *, retry_s: float) -> None:
    """Run ``run()`` until it returns or ``stop`` is set, running it again ``retry_s`` after each Redis outage
    that outlasted the client's retries (one ERROR line each, naming ``what``): for a part of a service that
    works against a Redis of its own (a lane's), whose outage must delay only that part, never end the
    service."""
    while not stop.is_set():
        try:
            await run()
            return
        except OUTAGE_ERRORS as e:
            logger.error("%s: redis still unreachable (%s); trying again in %.0f s", what, _one_line(e), retry_s)
        if await wait_set(stop, retry_s):
            return


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


def connect(url: str, *, outage_s: float = 60.0, max_connections: int = 256) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (``redis://`` or ``rediss://`` for TLS; password in the URL).

    It rides out an outage of up to ``outage_s`` seconds (:class:`OutageRetry`), and at most
    ``max_connections`` connections are open at once: a command that finds them all busy waits for
    one (never "Too many connections", however many entries a consumer retries at once).
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,
        decode_responses=False,
        health_check_interval=30,
        retry=OutageRetry(outage_s),
    )
    return aioredis.Redis(connection_pool=pool)


class Bus:
    """The writing side of the bus, bound to one Redis client: commits, transactions, publish.

    ``fence``: the lease every commit and transaction of this bus is fenced by (None: unfenced).
    ``outage_s``: how long the client retries (the ``once`` keys of re-sendable writes live twice as
    long); by default the client's :class:`OutageRetry`'s.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        maxlen: int = 100_000,
        max_message_bytes: int = 32 * 2**20,
        outage_s: float | None = None,
        retain_consumed_s: float = 0.0,
        max_command_bytes: int = 8 * 2**20,
        payload_orphan_ttl_s: float = 3600.0,
        payload_retention_s: float = 0.0,
        once_scope: str = "",
    ) -> None:
        self.redis = redis
        self.once_scope = once_scope
        """The service writing through this bus: its ``once`` keys are ``once:{once_scope}:{op}``, a namespace the
        ACL grants that service alone ("" = ``once:{op}``: tests and tools)."""
        self.payload_orphan_ttl_s = payload_orphan_ttl_s
        """Time to live of a trajectory payload until the commit referencing it (``redis.payload_orphan_ttl_s``)."""
        self.payload_retention_s = payload_retention_s
        """How long trained payloads are kept (``redis.payload_retention_s``; 0: deleted with the ack)."""
        self.max_command_bytes = max_command_bytes
        """Bulk bytes of one command at most (``redis.max_command_mb``): commit calls, payload reads."""
        self.retain_consumed_s = retain_consumed_s
        """Consumed entries younger than this are kept when consumer loops trim their stream (``redis.retain_consumed_s``)."""
        self.maxlen = maxlen
        self.max_message_bytes = max_message_bytes
        self.outage_s = outage_s if outage_s is not None else _client_outage_s(redis)
        self.fence: Fence | None = None
        self._commit = redis.register_script(COMMIT_LUA)
        self._tx = redis.register_script(TX_LUA)

    def encode(self, message: Message, stream: str) -> bytes:
        """``message`` encoded for ``stream``; :class:`MessageTooLargeError` over ``max_message_bytes``."""
        payload = encode(message)
        if len(payload) > self.max_message_bytes:
            raise MessageTooLargeError(
                f"a {type(message).__name__} of {len(payload) / 2**20:.1f} MiB for {stream} is over the "
                f"{self.max_message_bytes / 2**20:.1f} MiB limit (redis.max_message_mb)"
            )
        return payload

    def tx(self) -> Tx:
        """A new transaction on this bus (:mod:`streamrl.common.tx`): atomic, fenced, idempotent."""
        return Tx(self)

    async def run_tx_script(self, keys: list[str], args: list[Any]) -> Any:
        """One call of :data:`TX_LUA` (what :meth:`Tx.execute` sends)."""
        return await self._tx(keys=keys, args=args)

    async def publish(self, stream: str, message: Message) -> str:
        """Append one message to a bounded stream (a one-command transaction: fenced, written once); the entry id."""
        (entry_id,) = await self.tx().xadd(stream, message).execute()
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def commit(
        self,
        outputs: Sequence[Output],
        *,
        ack_stream: str = "",
        ack_group: str = "",
        ack_entry: str = "",
        ack: bool = True,
    ) -> bool:
        """Atomically write ``outputs`` and ack ``ack_entry`` - only while that entry is pending in ``ack_group``.

        Returns False when nothing was written because the entry was acknowledged already (a
        duplicate). ``ack=False`` checks the entry but leaves it pending. Without an entry the commit is
        written once (an operation id guards a re-send). LeaseLostError when fenced off.
        """
        args = self.commit_args(outputs, ack_stream=ack_stream, ack_group=ack_group, ack_entry=ack_entry, ack=ack)
        (reply,) = await self.run_commits([args])
        return _fresh(reply)

    def commit_args(
        self,
        outputs: Sequence[Output],
        *,
        ack_stream: str = "",
        ack_group: str = "",
        ack_entry: str = "",
        ack: bool = True,
    ) -> list[str | bytes | int]:
        """The ARGV of one commit (see :data:`COMMIT_LUA`), to be sent alone or with others."""
        if ack_entry and not (ack_stream and ack_group):
            raise ValueError(
                f"a commit of entry {ack_entry} needs its stream and group (got {ack_stream!r}, {ack_group!r})"
            )
        once = "" if ack_entry else _once_key_for(ack_stream, outputs, self.once_scope)
        ttl_ms = int(2 * self.outage_s * 1000)
        args: list[str | bytes | int] = [
            ack_stream,
            ack_group,
            ack_entry,
            int(ack),
            once,
            ttl_ms,
            self.maxlen,
            len(outputs),
        ]
        for out in outputs:
            if out.op != "write":
                code = {"persist": "p", "delete": "d", "expire": "e"}[out.op]
                args += [code, out.key or "", str(out.ttl_ms) if out.op == "expire" else "", ""]
                continue
            assert out.message is not None
            payload = self.encode(out.message, out.stream or out.key or "")
            if out.stream is not None:
                args += ["x", out.stream, "", payload]
            else:
                args += ["h", out.key or "", out.field or "", payload]
        return args

    async def run_commits(self, commits: Sequence[Sequence[str | bytes | int]]) -> list[Any]:
        """One :data:`COMMIT_LUA` call for ``commits`` (ARGV of each from :meth:`commit_args`): a reply each."""
        fence = self.fence
        args: list[str | bytes | int] = [len(commits), fence.key if fence else "", fence.token if fence else ""]
        for commit_args in commits:
            args += commit_args
        keys = commit_keys(commits) + ([fence.key] if fence else [])
        try:
            return list(await self._commit(keys=keys, args=args))
        except ResponseError as e:
            if str(e).startswith("FENCED "):
                raise fenced_error(fence, str(e).removeprefix("FENCED ").split(" script:")[0]) from None
            raise


def _client_outage_s(redis: aioredis.Redis) -> float:
    pool = getattr(redis, "connection_pool", None)
    retry = pool.connection_kwargs.get("retry") if pool is not None else None
    return retry.outage_s if isinstance(retry, OutageRetry) else 60.0


def _once_key_for(stream: str, outputs: Sequence[Output], scope: str) -> str:
    keys = [stream, *(out.stream or out.key or "" for out in outputs)]
    return once_key([k for k in keys if k], secrets.token_hex(12), scope)


def commit_keys(commits: Sequence[Sequence[str | bytes | int]]) -> list[str]:
    """The keys a call of :data:`COMMIT_LUA` touches, from the ARGV of each of its commits: the acked
    stream, the once key and every output's stream or hash (each once, in order; the fence key is added
    by :meth:`Bus.run_commits`)."""
    keys: dict[str, None] = {}
    for args in commits:
        stream, once = str(args[0]), str(args[4])
        keys.update({k: None for k in (stream, once) if k})
        for o in range(int(args[7])):
            keys[str(args[9 + 4 * o])] = None
    return list(keys)


def _fresh(reply: Any) -> bool:
    """One commit's reply: True (written) / False (a duplicate), or the write error raised."""
    if isinstance(reply, bytes | str):
        raise ResponseError(reply.decode() if isinstance(reply, bytes) else reply)
    return bool(reply)


class CommitBatcher:
    """Sends the commits of concurrently handled entries together: one script call per batch of at most
    ``MAX_COMMITS_PER_CALL`` commits and ``bus.max_command_bytes`` bytes (:func:`take_commits`).

    Each commit keeps its own outcome (written, duplicate, or its own error).
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._pending: list[tuple[list[str | bytes | int], asyncio.Future[bool], int]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def commit(self, outputs: Sequence[Output], **kwargs: Any) -> bool:
        """Like :meth:`Bus.commit`, sent with the other commits waiting."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        args = self.bus.commit_args(outputs, **kwargs)
        self._pending.append((args, future, commit_bytes(args)))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            n = take_commits([size for _, _, size in self._pending], self.bus.max_command_bytes)
            batch, self._pending = self._pending[:n], self._pending[n:]
            try:
                replies = await self.bus.run_commits([a for a, _, _ in batch])
            except Exception as e:  # noqa: BLE001 - the call failed as a whole: every waiter gets the error
                for _, future, _ in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, future, _), reply in zip(batch, replies, strict=True):
                if future.done():
                    continue
                try:
                    future.set_result(_fresh(reply))
                except ResponseError as e:
                    future.set_exception(e)
