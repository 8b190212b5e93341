"""Lanes: a run's data plane split into independent pipelines, each with its own keys and Redis.

With ``lanes.count = K > 1`` a run has K lanes and one *home*:

* **Lane k** (``lane = k`` in a service's config, ``STREAMRL_LANE=k``) is a whole intake pipeline: its
  coordinator (owning the dataset positions ``i mod K == k``), rollout and reward replicas, and every key they
  use - ``prompts``, ``trajectories``, ``scored``, the group buffers, the payloads, its coordinator's state and
  leases, its ``batches`` and a copy of ``weights`` - under the hash tag ``{run/lanek}``
  (:func:`lane_names`), on the Redis ``lanes.urls[k]`` (``redis.url`` when ``lanes.urls`` is empty). A
  rollout or reward replica talks to its lane's Redis only, exactly as it does in a run without lanes.
* **The home** is the run's own keys (``{run}``) on ``redis.url``: the joined ``batches`` the learner trains,
  ``weights`` as the learner publishes them, the learner's state. The coordinator of lane 0 also *joins*
  (``streamrl.coordinator.joining``): it mirrors every ``weights`` event into each lane, so every lane admits
  against the one policy version, and turns the K lane batches of each index into the one batch the learner
  trains (their samples' payloads stay in their lanes; the joined manifest names them by key).
* A key names its lane by its hash tag (:func:`lane_of_key`): the learner reads and deletes a joined batch's
  payloads on the Redis of the lane each key names (:class:`LaneClients`).

Because each lane's keys share one hash tag, the lanes of a Redis Cluster spread over its nodes by slot: a URL
of a cluster node is resolved to the node serving each lane's slot (:func:`node_url`) when a service connects.
With ``lanes.count = 1`` (the default) there are no lanes: every key is the run's, as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, model_validator

from streamrl.common.config import BaseConfig
from streamrl.common.streams import StreamNames

LANE_TAG = re.compile(r"\{([^{}/]+)/lane(\d+)\}")
"""The hash tag of a lane's keys: ``{run/lanek}``."""


class LanesConfig(BaseConfig):
    """How many lanes the run's data plane has and where each lives (:mod:`streamrl.common.lanes`)."""

    count: int = Field(1, ge=1, le=64)
    """Lanes (K): each a coordinator over the prompts ``i mod K == k`` with its own rollout and reward replicas
    and keys (``{run/lanek}``); 1 = no lanes."""
    urls: list[str] = []
    """Redis URL of each lane, in lane order (K of them); empty: every lane on ``redis.url``. A URL of a Redis
    Cluster node is resolved to the node serving the lane's slot."""

    @model_validator(mode="after")
    def _one_url_per_lane(self) -> LanesConfig:
        if self.urls and len(self.urls) != self.count:
            raise ValueError(
                f"lanes.urls names {len(self.urls)} Redis URLs for lanes.count = {self.count}: give one per lane, "
                "or none (every lane on redis.url)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.count > 1

    def url(self, lane: int, home_url: str) -> str:
        """The Redis URL of ``lane`` (``home_url``, the run's ``redis.url``, when ``urls`` is empty)."""
        if not 0 <= lane < self.count:
            raise ValueError(f"lane {lane} is not one of the run's {self.count} lanes (0..{self.count - 1})")
        return self.urls[lane] if self.urls else home_url


def lane_run_id(run_id: str, lane: int) -> str:
    """What lane ``lane``'s keys are named by (the hash tag's content): ``{run_id}/lane{lane}``."""
    return f"{run_id}/lane{lane}"


def lane_names(run_id: str, lane: int) -> StreamNames:
    """Every stream and key of lane ``lane`` of run ``run_id``."""
    return StreamNames(lane_run_id(run_id, lane))


def home_run_id(run_id: str) -> str:
    """The run a lane's keys belong to (``run`` of ``run/lanek``; any other id as it is): what the learner signs
    its weights events for, so a lane's reader checks them against it."""
    match = re.fullmatch(r"([^{}/]+)/lane\d+", run_id)
    return match.group(1) if match else run_id


def lane_of_key(key: str | bytes) -> int | None:
    """The lane a key belongs to (by its hash tag), None for a key of the run's home (or not streamrl's)."""
    text = key.decode() if isinstance(key, bytes) else key
    match = LANE_TAG.search(text)
    return int(match.group(2)) if match else None


def check_lane(service: str, lane: int | None, lanes: LanesConfig) -> str | None:
    """Why ``service`` cannot run with ``lane`` in a run of ``lanes`` (None: it can). Rollout, reward and
    coordinator serve one lane each when there are lanes; the learner serves the home."""
    if service == "learner":
        return None if lane is None else "the learner serves every lane: leave lane unset for it"
    if service not in ("coordinator", "rollout", "reward"):
        return None
    if not lanes.enabled:
        return None if lane in (None, 0) else f"lane = {lane} but lanes.count = 1 (no lanes)"
    if lane is None:
        return f"lanes.count = {lanes.count}: set lane (STREAMRL_LANE) to the lane this {service} serves, 0..{lanes.count - 1}"
    if not 0 <= lane < lanes.count:
        return f"lane = {lane} is not one of the run's {lanes.count} lanes (0..{lanes.count - 1})"
    return None


def node_url(url: str, key: str, cluster_slots: Callable[[], Sequence[Any]] | None) -> str:
    """The URL of the node serving ``key`` when ``url`` is a Redis Cluster node, else ``url``.

    ``cluster_slots``: returns ``CLUSTER SLOTS`` of that node (None: not a cluster). The URL keeps ``url``'s
    scheme, credentials and database; only host and port change."""
    if cluster_slots is None:
        return url
    slot = key_slot(key)
    for entry in cluster_slots():
        start, end, master = int(entry[0]), int(entry[1]), entry[2]
        if start <= slot <= end:
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            port = int(master[1])
            parts = urlsplit(url)
            auth = parts.netloc.rpartition("@")[0]
            netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
            return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    raise ValueError(f"no node of the Redis Cluster at {urlsplit(url).hostname} serves slot {slot} (of {key!r})")


def key_slot(key: str) -> int:
    """Redis Cluster's hash slot of ``key`` (CRC16-XMODEM of its hash tag, mod 16384)."""
    data = key.encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc % 16384


class LaneClients:
    """The Redis client of the home and of each lane, and which one holds a key (by its hash tag).

    ``clients[k]``: lane k's client; ``home``: the run's. Lanes on the same URL share one client."""

    def __init__(self, home: Any, clients: Sequence[Any]) -> None:
        self.home = home
        self.clients = list(clients)

    def for_key(self, key: str | bytes) -> Any:
        lane = lane_of_key(key)
        if lane is None or not self.clients:
            return self.home
        if lane >= len(self.clients):
            raise ValueError(f"key {key!r} names lane {lane}, but the run has {len(self.clients)} lanes")
        return self.clients[lane]

    def by_client(self, keys: Iterable[str]) -> list[tuple[Any, list[str]]]:
        """``keys`` grouped by the client holding them (each group in the keys' order)."""
        groups: dict[int, tuple[Any, list[str]]] = {}
        for key in keys:
            client = self.for_key(key)
            groups.setdefault(id(client), (client, []))[1].append(key)
        return list(groups.values())


async def resolve_url(url: str, key: str, *, outage_s: float = 60.0) -> str:
    """``url``, or when it is a Redis Cluster node's, the URL of the node serving ``key``'s slot
    (:func:`node_url`; a server with cluster support disabled answers ``CLUSTER SLOTS`` with an error).
    A Redis down at start is waited for like any outage (``outage_s``, :class:`~streamrl.common.bus.OutageRetry`):
    a service restarted while its Redis is still down does not fail at once claiming a long outage."""
    from redis.exceptions import ResponseError

    from streamrl.common.bus import connect

    client = connect(url, outage_s=outage_s, max_connections=1)
    try:
        try:
            slots = await client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
        except ResponseError:
            return url
    finally:
        await client.aclose()
    return node_url(url, key, lambda: slots)
