"""Replica counts of a live run: what is asked for, and what a launcher does about it.

The desired counts live in the Redis hash ``StreamNames(run_id).state("replicas")`` (field: service
name, value: replica count). Anyone may write it (``streamrl scale``, an autoscaler) through
:func:`request_replicas`; the launcher of the run (either backend) reads it every
``up.reconcile_interval_s`` and starts replicas at the next free index, or drains the highest ones
(SIGTERM: the service stops intake and finishes or hands back its in-flight entries).

In a run with lanes the counts are per lane: a field ``rollout`` is the count in every lane, a field
``rollout-lane1`` (the unit's name, :func:`streamrl.ops.lane_plan.unit_name`) the count in lane 1 alone, which
wins over the service's (:func:`desired_count`); asking for a service's count again clears its lanes' own.

Only rollout and reward scale: their replicas share one consumer group, each under its own
consumer name. The coordinator and the learner are single-instance (fixed consumer names, one
owner of the run state) and are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis as syncredis

from streamrl.common.streams import StreamNames
from streamrl.ops.lane_plan import split_unit
from streamrl.ops.up_config import SCALABLE, SERVICES

SINGLE_INSTANCE = tuple(s for s in SERVICES if s not in SCALABLE)


def replicas_key(names: StreamNames) -> str:
    """The hash of desired replica counts of a run."""
    return names.state("replicas")


def check_counts(counts: Mapping[str, int], max_replicas: Mapping[str, int] | None = None, lanes: int = 1) -> None:
    """Raise ValueError naming the service unless every count is for a scalable service (or, in a run of ``lanes``
    > 1 lanes, a lane's unit of one: ``rollout-lane1``), >= 0 and within ``max_replicas`` (where that names the
    service)."""
    if not counts:
        raise ValueError("no replica count given (e.g. rollout=3)")
    for name, count in counts.items():
        service, lane = split_unit(name)
        if lane is not None and lanes <= 1:
            raise ValueError(f"{name}: the run has no lanes (lanes.count = 1); give {service}={count}")
        if lane is not None and lane >= lanes:
            raise ValueError(f"{name}: lane {lane} is not one of the run's {lanes} lanes (0..{lanes - 1})")
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
    lanes: int = 1,
) -> None:
    """Ask the run's launcher for ``counts`` replicas (validated by :func:`check_counts`; nothing is written
    if any count is refused). Services not named keep their count; a service's count clears its lanes' own."""
    check_counts(counts, max_replicas, lanes)
    key = replicas_key(names)
    cleared = [f for f in map(_text, client.hkeys(key)) if split_unit(f)[1] is not None and split_unit(f)[0] in counts]
    pipe = client.pipeline(transaction=True)
    if cleared:
        pipe.hdel(key, *cleared)
    pipe.hset(key, mapping={name: int(n) for name, n in counts.items()})
    pipe.execute()


def desired_count(desired: Mapping[str, int], unit: str) -> int | None:
    """The count asked for ``unit`` (a service, or a lane's: ``rollout-lane1``): its own, else its service's."""
    return desired.get(unit, desired.get(split_unit(unit)[0]))


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
