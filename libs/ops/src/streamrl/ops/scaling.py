"""Replica counts of a live run: what is asked for, and what a launcher does about it.

The desired counts live in the Redis hash ``StreamNames(run_id).state("replicas")`` (field: service
name, value: replica count). Anyone may write it (``streamrl scale``, an autoscaler) through
:func:`request_replicas`; the launcher of the run (either backend) reads it every
``up.reconcile_interval_s`` and starts replicas at the next free index, or drains the highest ones
(SIGTERM: the service stops intake and finishes or hands back its in-flight entries).

Only rollout and reward scale: their replicas share one consumer group, each under its own
consumer name. The coordinator and the learner are single-instance (fixed consumer names, one
owner of the run state) and are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis as syncredis

from streamrl.common.streams import StreamNames
from streamrl.ops.up_config import SCALABLE, SERVICES

SINGLE_INSTANCE = tuple(s for s in SERVICES if s not in SCALABLE)


def replicas_key(names: StreamNames) -> str:
    """The hash of desired replica counts of a run."""
    return names.state("replicas")


def check_counts(counts: Mapping[str, int], max_replicas: Mapping[str, int] | None = None) -> None:
    """Raise ValueError naming the service unless every count is for a scalable service, >= 0 and within
    ``max_replicas`` (where that names the service)."""
    if not counts:
        raise ValueError("no replica count given (e.g. rollout=3)")
    for service, count in counts.items():
        if service in SINGLE_INSTANCE:
            raise ValueError(f"{service}: a single-instance service cannot be scaled; only {list(SCALABLE)} can")
        if service not in SCALABLE:
            raise ValueError(f"{service}: unknown service; scalable: {list(SCALABLE)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{service}: replica count must be an integer >= 0, got {count!r}")
        bound = (max_replicas or {}).get(service)
        if bound is not None and count > bound:
            raise ValueError(f"{service}: {count} replicas is over the maximum of {bound} (up.max_replicas)")


def request_replicas(
    client: syncredis.Redis,
    names: StreamNames,
    counts: dict[str, int],
    *,
    max_replicas: Mapping[str, int] | None = None,
) -> None:
    """Ask the run's launcher for ``counts`` replicas (validated by :func:`check_counts`; nothing is written
    if any count is refused). Services not named keep their count."""
    check_counts(counts, max_replicas)
    client.hset(replicas_key(names), mapping={service: int(n) for service, n in counts.items()})


def desired_replicas(client: syncredis.Redis, names: StreamNames) -> dict[str, int]:
    """The desired replica counts of the run, by service (only the services set in the hash)."""
    raw = client.hgetall(replicas_key(names))
    return {_text(k): int(v) for k, v in raw.items()}


def instance_name(service: str, index: int, incarnation: int) -> str:
    """Instance (and consumer) name of a replica: ``rollout-2`` at first, ``rollout-2.1`` once restarted or
    re-created, so two processes that may be alive at once never share a consumer name."""
    return f"{service}-{index}" if incarnation == 0 else f"{service}-{index}.{incarnation}"


def plan(desired: int, active: Iterable[int], occupied: Iterable[int]) -> tuple[list[int], list[int]]:
    """Indices to start and to drain so that ``desired`` replicas are active.

    ``active``: indices of replicas running or about to (re)start; ``occupied``: those plus the ones still
    draining, whose index is not free yet. New replicas take the lowest free indices; the highest active
    ones are drained first.
    """
    active = sorted(active)
    taken = set(occupied) | set(active)
    if desired < len(active):
        return [], active[desired:][::-1]
    start: list[int] = []
    index = 0
    while len(active) + len(start) < desired:
        if index not in taken:
            start.append(index)
        index += 1
    return start, []


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
