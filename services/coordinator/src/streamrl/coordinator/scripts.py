"""The coordinator's own server-side scripts, fenced and run once like the bus's transactions.

A state transition whose condition is more than "this key holds that value" (a group leaves
``inflight`` only if it is still a member; a dead batch counts only if its id is new) is a Lua script
of its own. :class:`FencedScript` wraps each one's body so that, like :mod:`streamrl.common.tx`:

* it writes nothing and raises :class:`~streamrl.common.lease.LeaseLostError` when another process
  holds the lease this bus is fenced by (``Bus.fence``, set once the coordinator holds its role);
* a re-send of the same call after a lost reply (the client's outage retry) returns the first
  execution's reply from its ``once`` key (kept twice ``redis.outage_s``) instead of running again -
  the bodies are written to be harmless when run twice anyway, and the ``once`` key keeps their reply
  (fresh or not) exact. The late-sample drops, called for every group touched on every tick and whose
  reply is only logged, take no ``once`` key (``once=False``): one key per call would be most of the
  run's ``once`` keys;
* a Redis at its ``maxmemory`` refuses it before it runs (``#!lua``), and the client retries.

A body sees its own ``KEYS`` and ``ARGV`` (the wrapper's are taken off) and returns an integer. The
wrapped script's second line is ``-- {module}.{CONSTANT} (fenced, ...)``, naming its body.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from streamrl.common.bus import Bus
from streamrl.common.tx import fenced_error, once_key

Arg = str | bytes | int | float

PROLOGUE = """#!lua
-- {name} (fenced, run once: streamrl.coordinator.scripts)
local once, ttl_ms = KEYS[1], ARGV[1]
if ttl_ms ~= '0' then
  local done = redis.call('GET', once)
  if done then return tonumber(done) end
end
if ARGV[2] ~= '' then
  local holder = redis.call('GET', KEYS[2])
  if holder and holder ~= ARGV[3] then return redis.error_reply('FENCED ' .. holder) end
end
local keys, argv = {}, {}
for i = 3, #KEYS do keys[i - 2] = KEYS[i] end
for i = 4, #ARGV do argv[i - 3] = ARGV[i] end
local KEYS, ARGV = keys, argv
local function body()
"""
EPILOGUE = """
end
local reply = body()
if ttl_ms ~= '0' then redis.call('SET', once, reply, 'PX', ttl_ms) end
return reply
"""


class FencedScript:
    """One script body (see the module docstring), called like a redis-py script: ``await s(keys, args)``."""

    def __init__(self, bus: Bus, body: str, name: str, *, once: bool = True) -> None:
        self.bus = bus
        self.name = name
        """``module.CONSTANT`` of the body: the script's second line names it (tools that watch Redis)."""
        self.once = once
        """Keep each call's reply under a ``once`` key; False for a body whose reply may change when run
        again without harm (a count only logged) and that runs often: no key written per call."""
        self.source = PROLOGUE.replace("{name}", name) + body + EPILOGUE
        self._script = bus.redis.register_script(self.source)

    def _full(self, keys: Sequence[str], args: Sequence[Arg]) -> tuple[list[str], list[Arg]]:
        fence = self.bus.fence
        once = once_key(list(keys), secrets.token_hex(12), self.bus.once_scope)
        ttl_ms = int(2 * self.bus.outage_s * 1000) if self.once else 0
        head: list[Arg] = [ttl_ms, fence.key if fence else "", fence.token if fence else ""]
        return [once, fence.key if fence else once, *keys], [*head, *args]

    async def __call__(self, keys: Sequence[str], args: Sequence[Arg]) -> int:
        full_keys, full_args = self._full(keys, args)
        try:
            return int(await self._script(keys=full_keys, args=full_args))
        except ResponseError as e:
            raise self.fenced(e) from None

    async def queue(self, pipe: Pipeline, keys: Sequence[str], args: Sequence[Arg]) -> None:
        """Add one call to ``pipe`` (nothing is sent yet); read its reply with :meth:`replies`."""
        full_keys, full_args = self._full(keys, args)
        await self._script(keys=full_keys, args=full_args, client=pipe)

    async def replies(self, pipe: Pipeline) -> list[int]:
        """Execute ``pipe`` (holding only calls of fenced scripts): their replies."""
        try:
            return [int(r) for r in await pipe.execute()]
        except ResponseError as e:
            raise self.fenced(e) from None

    def fenced(self, error: ResponseError) -> Exception:
        """``LeaseLostError`` for a call refused by the fence; any other script error unchanged."""
        text = str(error)
        if text.startswith("FENCED "):
            return fenced_error(self.bus.fence, text.removeprefix("FENCED ").split(" script:")[0])
        return error
