"""Where a rollout worker fetches a ``relay`` version from: pure, from the registry's view of who holds what.

Every live rollout worker's heartbeat carries its relay endpoint (``weights_relay``) and the version it
serves (``policy_version``). For version ``v`` a worker fetches, nearest first, from:

1. the peers that serve ``v`` whole already (a late joiner, or a retry after a failed fetch: nothing to
   wait for), by instance name;
2. its parent in the relay among the workers still below ``v`` (itself included), ordered by instance name
   with the learner as the root: :func:`streamrl.common.weights.relay.upstreams` (``fanout`` 1: a chain),
   then that parent's own upstreams, nearest first;
3. the learner (added by the receiver: the event names it).

Every worker computes its list alone, and an upstream always sorts before its downstream, so two workers
whose views of the registry differ for a beat still never wait on each other in a circle. A peer that
serves a newer version already is left out (a node holds one version). A dead upstream fails at once (the
connection is refused or cut) and a stalled one after ``rollout.relay_stall_s``: the next one resumes at the
first chunk still missing.
"""

from __future__ import annotations

from typing import NamedTuple

from streamrl.common.weights.relay import Address, upstreams

LEARNER = ("learner", 0)
"""The root's place in the order (the receiver adds the event's endpoint itself)."""


class Peer(NamedTuple):
    """A live rollout worker as its heartbeat shows it."""

    instance: str
    endpoint: str
    """``host:port`` of its relay node (empty: it has none yet)."""
    version: int
    """The policy version it serves."""


def parse_address(endpoint: str) -> Address:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def relay_upstreams(me: Peer, peers: list[Peer], version: int, fanout: int = 1) -> list[Address]:
    """The peers ``me`` fetches ``version`` from, nearest first (the learner not included)."""
    others = [p for p in peers if p.instance != me.instance and p.endpoint]
    holders = [parse_address(p.endpoint) for p in sorted(others) if p.version == version]
    fetching = sorted([p for p in others if p.version < version] + [me])
    order: list[Address] = [LEARNER, *(parse_address(p.endpoint) for p in fetching)]
    chain = upstreams(order, fetching.index(me) + 1, fanout)
    return holders + [a for a in chain if a != LEARNER]
