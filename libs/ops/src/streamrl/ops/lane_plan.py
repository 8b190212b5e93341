"""Which processes ``streamrl up`` starts for a run with lanes (:mod:`streamrl.common.lanes`), and with what lane.

With ``lanes.count = K > 1`` every lane is a whole intake pipeline: the launcher starts, per lane ``k``, one
coordinator and ``up.replicas`` rollout and reward replicas (the counts are *per lane*), each with
``STREAMRL_LANE=k``; the learner is one for the run (it reads every lane). A backend places *units*: a service,
or a service of one lane (:func:`unit_name`, ``rollout-lane1``), each unit with its own replica indices, so a
replica's instance name says its lane (``rollout-lane1-0``) and names never collide across lanes. With K = 1
the units are the services, unchanged.

Embedded Redis: one redis-server per lane, lane 0's also the home (:func:`embedded_servers`), each with its
share of the run's ``maxmemory`` (:func:`server_maxmemory`); their URLs go to
every service as ``lanes.urls`` (:func:`lanes_env`). When the recipe gives ``redis.url`` or ``lanes.urls`` none
is started: lanes without ``lanes.urls`` all live on ``redis.url``, and a home without ``redis.url`` is lane 0's
Redis (:func:`home_url`).

All pure: the launcher, both backends and ``streamrl up --dry-run`` use these.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

LANE_SERVICES = ("coordinator", "rollout", "reward")
"""The services that serve one lane each when a run has lanes (:func:`streamrl.common.lanes.check_lane`)."""
LANE_ENV = "STREAMRL_LANE"
LANE_SUFFIX = "-lane"


def unit_name(service: str, lane: int | None) -> str:
    """The unit of ``service`` in ``lane`` (``rollout-lane1``); the service itself without a lane."""
    return service if lane is None else f"{service}{LANE_SUFFIX}{lane}"


def split_unit(unit: str) -> tuple[str, int | None]:
    """``(service, lane)`` of a unit (:func:`unit_name`): ``rollout-lane1`` -> ``("rollout", 1)``."""
    service, sep, lane = unit.rpartition(LANE_SUFFIX)
    if sep and service in LANE_SERVICES and lane.isdigit():
        return service, int(lane)
    return unit, None


def units(services: Sequence[str], lanes: int) -> list[str]:
    """The units of ``services`` in a run of ``lanes`` lanes, in start order: each service's units together
    (lane 0 first), services in their order."""
    out: list[str] = []
    for service in services:
        lane_units = lanes > 1 and service in LANE_SERVICES
        out += [unit_name(service, k) for k in range(lanes)] if lane_units else [service]
    return out


def unit_env(unit: str) -> dict[str, str]:
    """What a unit's processes get in their environment besides the run's: ``STREAMRL_LANE`` for a lane's."""
    _, lane = split_unit(unit)
    return {} if lane is None else {LANE_ENV: str(lane)}


def lanes_env(urls: Sequence[str]) -> dict[str, str]:
    """``lanes.urls`` for every service, as an environment variable (JSON, as the config loader reads it)."""
    return {"STREAMRL_LANES__URLS": json.dumps(list(urls))} if urls else {}


def embedded_servers(lanes: int, redis_url: str | None, lane_urls: Sequence[str]) -> int:
    """How many redis-servers ``streamrl up`` starts: none when the recipe names a Redis (``redis.url`` or
    ``lanes.urls``), else one per lane (one without lanes)."""
    if redis_url or lane_urls:
        return 0
    return max(1, lanes)


SERVER_FLOOR_BYTES = 64 * 2**20
"""The least ``maxmemory`` a lane's embedded redis-server gets (a whole run's floor too)."""


def server_maxmemory(total: int, servers: int) -> int:
    """``maxmemory`` of each of ``servers`` embedded redis-servers sharing the run's ``total`` (bytes; 0 = no
    limit): an even share (the lanes split the data plane evenly), rounded up to a MiB, at least
    :data:`SERVER_FLOOR_BYTES`."""
    if total == 0 or servers <= 1:
        return total
    mib = 2**20
    return max(SERVER_FLOOR_BYTES, -(-total // (servers * mib)) * mib)


def home_url(redis_url: str | None, lane_urls: Sequence[str]) -> str | None:
    """The home's Redis: ``redis.url``, else lane 0's (``lanes.urls[0]``), else None (an embedded one)."""
    return redis_url or (lane_urls[0] if lane_urls else None)


@dataclass(frozen=True)
class Planned:
    """One replica ``streamrl up`` starts: its unit, service, lane, index, instance name and lane environment."""

    unit: str
    service: str
    lane: int | None
    index: int
    name: str
    env: dict[str, str]


def plan_processes(services: Sequence[str], replicas: dict[str, int], lanes: int) -> list[Planned]:
    """Every replica ``streamrl up`` starts at first, in order (``replicas``: per service, per lane with lanes;
    default 1). Instance names as at a replica's first start (``{unit}-{index}``)."""
    out = []
    for unit in units(services, lanes):
        service, lane = split_unit(unit)
        for i in range(replicas.get(service, 1)):
            out.append(Planned(unit, service, lane, i, f"{unit}-{i}", unit_env(unit)))
    return out
