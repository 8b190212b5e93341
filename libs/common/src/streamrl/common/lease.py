"""Leases: a Redis key that one process holds at a time, kept alive while it runs.

Two uses, both taken in :mod:`streamrl.common.lifecycle` before a service starts work:

* every instance leases its **name** (``lease:instance:{service}:{instance}``): the name is its
  consumer name in every group, so two live processes under one name would share pending entries
  silently. A second process under a live name waits up to one lease TTL (the first may have just
  been killed: its lease then expires) and then refuses to start;
* the **coordinator** and the **learner** (its rank 0) lease their role (``lease:singleton:{service}``):
  there is one of each per run. A second one refuses to start, naming the holder, or with
  ``standby`` waits and takes over when the holder's lease expires (it stopped or died).

A lease is a ``SET NX PX`` of a token naming its holder; renewing and releasing check the token (a
Lua script), so a holder that stalled past its TTL and lost the lease to another process learns it at
its next renewal and stops instead of working beside its successor. Every take also counts in
``{lease}:takes``, and each holder remembers its take: a holder whose lease expired takes it again at
renewal only if nobody took it meanwhile - a standby that took it over and then released it (or died with it)
leaves the count moved, and the stalled holder stops instead of resuming where its successor worked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

TAKES_TTL_S = 86_400
"""How long a lease's take count outlives its last take or renewal (s)."""
ACQUIRE_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local take = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return {1, tostring(take)}
end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return {1, redis.call('GET', KEYS[2]) or ''} end
return {0, holder}
"""
"""Take a lease if it is free. KEYS: the lease, its take count; ARGV: token, TTL ms, the count's TTL ms. Reply
``{1, this take's number}`` (taken now, or by this very process before: a re-sent call) or ``{0, holder}``."""
RENEW_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  return 1
end
if not holder then
  local takes = redis.call('GET', KEYS[2])
  if takes and takes ~= ARGV[3] then return 3 end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
  return 2
end
return holder
"""
"""Renew a lease in one step. KEYS: the lease, its take count; ARGV: token, TTL ms, this holder's take, the
count's TTL ms. Reply 1 (extended), 2 (it had expired with nobody taking it: taken again), 3 (it expired and
another process took it meanwhile, and gave it up or died: lost) or the token of the process holding it now.
One script, so two renewers of one process (the start-up thread and the heartbeat) cannot see each other's
re-take as another holder, and a re-sent call (lost reply) finds the lease its first run took."""
TAKEN_MEANWHILE = 3
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseHeldError(RuntimeError):
    """Another live process holds the lease."""


class LeaseLostError(RuntimeError):
    """The lease expired or was taken over while this process held it."""


def holder_token(instance: str) -> str:
    """``{instance}@{host}:{pid}/{random}``: unique per process, readable in an error message."""
    return f"{instance}@{socket.gethostname()}:{os.getpid()}/{secrets.token_hex(4)}"


def holder_of(token: str) -> str:
    """The readable part of a token (without its random suffix)."""
    return token.rsplit("/", 1)[0]


class Lease:
    """One lease: ``await acquire()``, then ``await renew()`` more often than ``ttl_s``, ``await release()``."""

    def __init__(self, redis: aioredis.Redis, key: str, token: str, ttl_s: float, what: str) -> None:
        self.redis = redis
        self.key = key
        self.token = token
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.what = what
        """What is leased, for messages (e.g. ``the coordinator of run demo``)."""
        self.take = ""
        """Which take of the lease this process holds (``{key}:takes`` when it took it), set by :meth:`acquire`."""

    async def try_acquire(self) -> str | None:
        """Take the lease if it is free: None, else the current holder's token."""
        keys = [self.key, takes_key(self.key)]
        taken, value = await self.redis.eval(ACQUIRE_LUA, 2, *keys, self.token, self.ttl_ms, TAKES_TTL_S * 1000)
        if taken:
            self.take = _text(value)
            return None
        return _text(value)

    async def acquire(self, wait_s: float | None, stop: asyncio.Event | None = None) -> bool:
        """Take the lease, waiting up to ``wait_s`` (None: until it is free or ``stop`` is set) for the
        holder's to expire. True once held; False if ``stop`` was set first. LeaseHeldError after ``wait_s``."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        holder = await self.try_acquire()
        if holder is not None:
            logger.warning(
                "%s is held by %s: waiting for its lease to expire%s",
                self.what,
                holder_of(holder),
                "" if wait_s is None else f" (up to {wait_s:.1f} s)",
            )
        while holder is not None:
            if stop is not None and stop.is_set():
                return False
            if deadline is not None and time.monotonic() >= deadline:
                raise LeaseHeldError(
                    f"{self.what} is held by a live process ({holder_of(holder)}): refusing to start a second one"
                )
            await asyncio.sleep(min(0.2, self.ttl_ms / 4000))
            holder = await self.try_acquire()
        return True

    async def renew(self) -> None:
        """Extend the lease by its TTL; LeaseLostError if another process holds it now.

        A lease that expired with nobody taking it (Redis restarted, or this process stalled past the
        TTL with no standby waiting) is taken again: still only one holder."""
        reply = await self.redis.eval(RENEW_LUA, 2, *self.renew_args())
        if reply == 2:
            logger.warning("the lease on %s had expired with nobody taking it: holding it again", self.what)
        elif reply != 1:
            raise LeaseLostError(f"lost the lease on {self.what} ({lost_to(reply)}): stopping")

    def renew_args(self) -> list[str | int]:
        """KEYS and ARGV of :data:`RENEW_LUA` for this lease (the start-up renewer thread calls it too)."""
        return [self.key, takes_key(self.key), self.token, self.ttl_ms, self.take, TAKES_TTL_S * 1000]

    async def release(self) -> None:
        """Give the lease up (only if still held: never deletes a successor's)."""
        await self.redis.eval(RELEASE_LUA, 1, self.key, self.token)


def takes_key(key: str) -> str:
    """The count of takes of lease ``key`` (same hash slot: the key's tag)."""
    return f"{key}:takes"


def lost_to(reply: bytes | str | int) -> str:
    """Why a renewal that did not extend the lease (``reply`` of :data:`RENEW_LUA`) lost it, for messages."""
    if reply == TAKEN_MEANWHILE:
        return "it expired, and another process took it over meanwhile and gave it up"
    return f"it expired; now held by {holder_of(_text(reply))}"  # type: ignore[arg-type]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
