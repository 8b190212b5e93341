"""Judging a peer consumer dead, and forgetting it safely (used by :class:`streamrl.common.consumer.ConsumerLoop`).

A consumer named after an instance (``{service}:{name}`` in the run's ``instances`` set) whose
heartbeat key is gone is dead - but only when this process can trust what it sees:

* not right after a Redis outage: a blip longer than the heartbeat TTL lets every heartbeat expire,
  and every worker would take over every other's in-flight work. Peers are judged only once this
  process has seen Redis healthy for one heartbeat TTL since its last outage
  (:meth:`streamrl.common.bus.OutageRetry.healthy_for`);
* not on one look: the heartbeat must be missing on two looks at least one heartbeat interval apart
  (:class:`PeerWatch`), so a beat that is merely late is not taken for a death;
* one pipelined EXISTS per round for every candidate, whatever their number.

A dead consumer that holds no more entries is deleted from the group by :data:`FORGET_LUA`, which
checks and deletes in one step: a separate check could let the consumer (alive after all) read an
entry between the two, and ``XGROUP DELCONSUMER`` would drop that entry from the PEL - never
redelivered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FORGET_LUA = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('SREM', KEYS[2], ARGV[i]) end
end
return 1
"""
"""KEYS: the stream, the instances set, then the heartbeat key of each instance of that name. ARGV:
group, consumer, then (from index 3, matching KEYS) each instance's ``{service}:{name}`` member.
Deletes the consumer only if it holds no pending entry, and forgets each instance whose heartbeat is
still absent. Reply 1 (forgotten) or 0 (it holds entries again: kept)."""


@dataclass
class PeerWatch:
    """Which peers have had no heartbeat on two looks at least ``interval_s`` apart."""

    interval_s: float
    missing_since: dict[str, float] = field(default_factory=dict)
    """Peer name -> when its heartbeat was first seen missing (this run of misses)."""

    def look(self, missing: set[str], seen: set[str], now: float) -> set[str]:
        """Record one look (``missing``: peers whose heartbeat is absent, ``seen``: present): the
        peers judged dead now."""
        for name in seen:
            self.missing_since.pop(name, None)
        for name in missing:
            self.missing_since.setdefault(name, now)
        return {name for name in missing if now - self.missing_since[name] >= self.interval_s}

    def forget(self, name: str) -> None:
        self.missing_since.pop(name, None)


def may_judge(healthy_for_s: float, heartbeat_ttl_s: float) -> bool:
    """Whether peers may be judged dead: Redis healthy (as this process saw it) for one heartbeat TTL."""
    return healthy_for_s >= heartbeat_ttl_s
