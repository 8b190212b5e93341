"""Transactions that are atomic, fenced and idempotent: what a service writes beyond a consumer's commit.

``tx = bus.tx()`` queues Redis commands like a pipeline; ``await tx.execute()`` runs them as one Lua
script (:data:`TX_LUA`), which in this order:

1. returns the stored replies if this very transaction already ran (see *idempotent* below);
2. checks the **fence** (:class:`Fence`, set by :mod:`streamrl.common.lifecycle` once the service
   holds its lease): if the lease key holds another process's token, nothing is written and
   :class:`~streamrl.common.lease.LeaseLostError` is raised naming the holder (a key with no value -
   expired, nobody took it - lets the write go on: renewal takes it again or stops the service);
3. checks the **preconditions** (``tx.require(key, equals=value)``; ``None`` = the key is absent):
   the first that fails writes nothing and raises :class:`PreconditionFailed` (key, wanted, found);
4. runs every queued command, in order, and replies as redis-py would (ints, bytes, lists, ``None``,
   ``True`` for ``OK``); a command that fails (say, WRONGTYPE) does not stop the others - as with
   MULTI/EXEC - and its error is raised after all ran;
5. stores the replies (cmsgpack) under ``streamrl:{run}:once:{service}:{op}`` for twice ``redis.outage_s`` (each
   service's own namespace: ``Bus.once_scope``).

*Idempotent*: each ``execute()`` draws a random operation id ``op``. When the connection drops after
Redis ran the script but before the reply arrived, the client's outage retry
(:class:`streamrl.common.bus.OutageRetry`) sends the same script call again; it finds its ``once``
key and returns the first execution's replies without running anything again. A transaction is
therefore executed once however often the client re-sends it - but a *new* ``execute()`` (a new
``Tx``) is a new operation: code that retries on its own must rebuild its precondition so the
second try cannot apply twice.

The script is flagged (``#!lua``): a Redis at its ``maxmemory`` refuses it before it runs anything
(``OOM``, retried by :class:`~streamrl.common.bus.OutageRetry` like an outage). Every key is declared
in KEYS (Redis Cluster): they must share the run's ``{run}`` hash tag, and the ``once`` key takes it
from the first key that has one.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
from redis.exceptions import ResponseError

from streamrl.common.codec import PAYLOAD_FIELD
from streamrl.common.lease import LeaseLostError, holder_of

if TYPE_CHECKING:
    from streamrl.common.bus import Bus
    from streamrl.common.messages import Message

Value = str | bytes | int | float

TX_LUA = """#!lua
local done = redis.call('GET', KEYS[1])
if done then return {0, done} end
local ttl_ms, fence_key, fence_token = ARGV[1], ARGV[2], ARGV[3]
if fence_key ~= '' then
  local holder = redis.call('GET', fence_key)
  if holder and holder ~= fence_token then return {1, holder} end
end
local p = 5
for i = 1, tonumber(ARGV[4]) do
  local key, absent, want = ARGV[p], ARGV[p + 1], ARGV[p + 2]
  p = p + 3
  local found = redis.call('GET', key)
  if (absent == '1' and found) or (absent ~= '1' and found ~= want) then return {2, i, found} end
end
local replies = {}
local n = tonumber(ARGV[p])
p = p + 1
for c = 1, n do
  local argc = tonumber(ARGV[p])
  local r = redis.pcall(unpack(ARGV, p + 1, p + argc))
  p = p + argc + 1
  if type(r) == 'table' and r.err then r = {err = r.err} end
  replies[c] = r
end
local packed = cmsgpack.pack(replies)
redis.call('SET', KEYS[1], packed, 'PX', ttl_ms)
return {0, packed}
"""
"""KEYS: the ``once`` key, then every key the transaction touches (fence key included). ARGV:
``ttl_ms fence_key fence_token n_preconditions``, per precondition ``key absent(1/0) value``, then
``n_commands`` and per command ``argc name args...``. Reply ``{0, packed replies}`` (ran now or
before), ``{1, holder}`` (fenced) or ``{2, precondition index, found}``."""

_HASH_TAG = re.compile(r"\{([^}]+)\}")


@dataclass(frozen=True)
class Fence:
    """The lease a bus's writes are fenced by: ``key`` must hold ``token``, or nothing (expired)."""

    key: str
    token: str


class PreconditionFailed(RuntimeError):  # noqa: N818 - the name the services code against
    """A ``tx.require`` did not hold: nothing of the transaction was written."""

    def __init__(self, key: str, wanted: Value | None, found: bytes | None) -> None:
        want = "absent" if wanted is None else repr(wanted)
        super().__init__(f"precondition failed on {key}: wanted {want}, found {'absent' if found is None else found!r}")
        self.key, self.wanted, self.found = key, wanted, found


def once_key(keys: list[str], op: str, scope: str = "") -> str:
    """``streamrl:{run}:once:{scope}:{op}`` (``scope``: the writing service, whose ACL user alone may touch its
    ``once`` keys; "" = ``once:{op}``), with the hash tag of the first key that has one (one Cluster slot)."""
    name = f"once:{scope}:{op}" if scope else f"once:{op}"
    for key in keys:
        if tag := _HASH_TAG.search(key):
            return f"streamrl:{{{tag.group(1)}}}:{name}"
    return f"streamrl:{name}"


def decode_replies(packed: bytes) -> list[Any]:
    """The stored replies as redis-py gives them: errors as :class:`ResponseError`, ``OK`` as True,
    a Lua ``false`` (nil reply) as None."""
    replies = msgpack.unpackb(packed, raw=True, strict_map_key=False)
    return [_reply(r) for r in replies] if isinstance(replies, list) else []


def _reply(value: Any) -> Any:
    if value is False:
        return None
    if isinstance(value, dict):
        if b"err" in value:
            return ResponseError(value[b"err"].decode(errors="replace"))
        if b"ok" in value:
            return True if value[b"ok"] == b"OK" else value[b"ok"]
        return [] if not value else {k: _reply(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_reply(v) for v in value]
    return value


@dataclass
class Tx:
    """Redis commands queued for one atomic, fenced, idempotent script call (see the module docstring).

    Example:
        tx = bus.tx()
        tx.require(names.state("batch_index"), equals=b"7")
        tx.xadd(names.batches, batch)
        tx.set(names.state("batch_index"), 8)
        first_id, _ = await tx.execute()
    """

    bus: Bus
    commands: list[list[Value]] = field(default_factory=list)
    keys: dict[str, None] = field(default_factory=dict)
    preconditions: list[tuple[str, Value | None]] = field(default_factory=list)

    def call(self, name: str, key: str, *args: Value) -> Tx:
        """Queue any single-key command: ``tx.call("HSETNX", key, field, value)``."""
        self.keys[key] = None
        self.commands.append([name, key, *args])
        return self

    def require(self, key: str, *, equals: Value | None) -> Tx:
        """Run only if string ``key`` holds ``equals`` now (``None``: only if ``key`` does not exist)."""
        self.keys[key] = None
        self.preconditions.append((key, equals))
        return self

    def xadd(self, stream: str, message: Message, maxlen: int | None = None) -> Tx:
        """Append ``message`` (size-checked, :meth:`Bus.encode`); the stream capped at about ``maxlen``
        entries (default: the bus's ``redis.maxlen``, the safety cap)."""
        return self.xadd_raw(stream, self.bus.encode(message, stream), maxlen=maxlen)

    def xadd_raw(self, stream: str, payload: bytes, maxlen: int | None = None) -> Tx:
        """Append an already encoded payload (its entry id is the reply)."""
        cap = self.bus.maxlen if maxlen is None else maxlen
        return self.call("XADD", stream, "MAXLEN", "~", cap, "*", PAYLOAD_FIELD, payload)

    def incr(self, key: str) -> Tx:
        return self.call("INCR", key)

    def incrby(self, key: str, amount: int) -> Tx:
        return self.call("INCRBY", key, amount)

    def set(self, key: str, value: Value, px: int | None = None) -> Tx:
        """SET, with a time to live of ``px`` ms if given."""
        return self.call("SET", key, value, *(("PX", px) if px is not None else ()))

    def delete(self, *keys: str) -> Tx:
        for key in keys:
            self.call("DEL", key)
        return self

    def rename(self, key: str, new_key: str) -> Tx:
        """RENAME (both keys declared); an error when ``key`` does not exist, so queue it before any write."""
        self.keys[new_key] = None
        return self.call("RENAME", key, new_key)

    def expire(self, key: str, seconds: int) -> Tx:
        return self.call("EXPIRE", key, seconds)

    def hset(self, key: str, field_: Value, value: Value) -> Tx:
        return self.call("HSET", key, field_, value)

    def hincrby(self, key: str, field_: Value, amount: int) -> Tx:
        return self.call("HINCRBY", key, field_, amount)

    def hdel(self, key: str, *fields: Value) -> Tx:
        return self.call("HDEL", key, *fields)

    def sadd(self, key: str, *members: Value) -> Tx:
        return self.call("SADD", key, *members)

    def srem(self, key: str, *members: Value) -> Tx:
        return self.call("SREM", key, *members)

    def rpush(self, key: str, *values: Value) -> Tx:
        return self.call("RPUSH", key, *values)

    def lpush(self, key: str, *values: Value) -> Tx:
        return self.call("LPUSH", key, *values)

    def lrem(self, key: str, count: int, value: Value) -> Tx:
        return self.call("LREM", key, count, value)

    def zadd(self, key: str, mapping: dict[str, float]) -> Tx:
        pairs = [x for member, score in mapping.items() for x in (score, member)]
        return self.call("ZADD", key, *pairs)

    def zrem(self, key: str, *members: Value) -> Tx:
        return self.call("ZREM", key, *members)

    def xack(self, stream: str, group: str, *entry_ids: Value) -> Tx:
        return self.call("XACK", stream, group, *entry_ids)

    def script_args(self, op: str) -> tuple[list[str], list[Value]]:
        """KEYS and ARGV of :data:`TX_LUA` for operation id ``op``."""
        fence = self.bus.fence
        keys = list(self.keys) + ([fence.key] if fence is not None and fence.key not in self.keys else [])
        ttl_ms = int(2 * self.bus.outage_s * 1000)
        args: list[Value] = [ttl_ms, fence.key if fence else "", fence.token if fence else "", len(self.preconditions)]
        for key, wanted in self.preconditions:
            args += [key, "1" if wanted is None else "0", "" if wanted is None else wanted]
        args.append(len(self.commands))
        for command in self.commands:
            args += [len(command), *command]
        return [once_key(keys, op, self.bus.once_scope), *keys], args

    async def execute(self) -> list[Any]:
        """Run the queued commands once (see the module docstring): their replies, in order.

        Raises :class:`~streamrl.common.lease.LeaseLostError` (fenced), :class:`PreconditionFailed`,
        or the first command's ``ResponseError`` (the other commands ran)."""
        keys, args = self.script_args(secrets.token_hex(12))
        reply = await self.bus.run_tx_script(keys, args)
        kind = int(reply[0])
        if kind == 1:
            raise fenced_error(self.bus.fence, reply[1])
        if kind == 2:
            key, wanted = self.preconditions[int(reply[1]) - 1]
            raise PreconditionFailed(key, wanted, reply[2] if len(reply) > 2 else None)
        replies = decode_replies(reply[1])
        for r in replies:
            if isinstance(r, ResponseError):
                raise r
        return replies


def fenced_error(fence: Fence | None, holder: bytes | str) -> LeaseLostError:
    """The error of a write refused by the fence: who holds the lease now."""
    text = holder.decode() if isinstance(holder, bytes) else holder
    where = fence.key if fence else "its lease"
    return LeaseLostError(f"write refused: {where} is held by {holder_of(text)} now (this process lost its lease)")
