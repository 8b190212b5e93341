"""The learner's clients of a run's lanes (:mod:`streamrl.common.lanes`): where it reads and deletes the payloads
and manifest parts a joined batch names.

With ``lanes.count = K > 1`` the learner consumes the joined ``batches`` of the home, but each sample's payload
stays in the lane that produced it (``streamrl:{run/lanek}:batched:...``, on ``lanes.urls[k]``). The learner
holds one client per distinct lane URL - lanes on one URL share it, and a lane on the home's URL uses the home's
client - each made by :func:`streamrl.common.bus.connect` with no end to its outage retries: a lane's Redis going
down is waited out however long it lasts (one WARNING line when it goes, one INFO line when it is back). Its
reads wait, the batch is never skipped for it, and the learner never exits for it: the lane's payloads are
durable (AOF) and needed in index order, and a restarted learner would wait for the same lane. Only the home's
outage (``redis.outage_s``: the learner's leases and heartbeat live there) ends the learner. A cluster node's
URL is resolved to the node serving each lane's slot (:func:`~streamrl.common.lanes.resolve_url`), a lane's
waited for the same way. With one lane the learner has the home client alone
(:class:`~streamrl.common.lanes.LaneClients` with no lanes).
"""

from __future__ import annotations

import math
from typing import Any

from streamrl.common.bus import connect
from streamrl.common.config import RedisConfig
from streamrl.common.lanes import LaneClients, LanesConfig, lane_names, resolve_url
from streamrl.common.streams import StreamNames

LANE_OUTAGE_S = math.inf
"""How long the learner's lane clients retry through their Redis's outage: until it answers."""


def lane_urls(lanes: LanesConfig, home_url: str) -> list[str]:
    """The configured Redis URL of each lane, in lane order (none without lanes)."""
    return [lanes.url(k, home_url) for k in range(lanes.count)] if lanes.enabled else []


def share_clients(home_url: str, urls: list[str]) -> list[int]:
    """For each lane URL, which connection it uses: -1 the home's (same URL), else the index of the first lane
    with that URL (pure)."""
    first: dict[str, int] = {}
    return [-1 if url == home_url else first.setdefault(url, k) for k, url in enumerate(urls)]


async def connect_lanes(home: Any, run_id: str, lanes: LanesConfig, redis: RedisConfig) -> LaneClients:
    """The home client ``home`` (on ``redis.url``) and a client per lane of the run (:func:`share_clients`)."""
    if not lanes.enabled:
        return LaneClients(home, [])
    if redis.url is None:
        raise ValueError("lanes.count > 1 needs redis.url (the home's Redis) for the learner")
    home_url = await resolve_url(redis.url, StreamNames(run_id).prompts, outage_s=redis.outage_s)  # on a cluster
    urls = [
        await resolve_url(url, lane_names(run_id, k).prompts, outage_s=LANE_OUTAGE_S)
        for k, url in enumerate(lane_urls(lanes, home_url))
    ]
    made: dict[int, Any] = {}
    clients = []
    for k, shared in enumerate(share_clients(home_url, urls)):
        if shared < 0:
            clients.append(home)
            continue
        if shared not in made:
            made[shared] = connect(urls[k], outage_s=LANE_OUTAGE_S, max_connections=redis.max_connections)
        clients.append(made[shared])
    return LaneClients(home, clients)


async def close_lanes(clients: LaneClients) -> None:
    """Close the lane clients of ``clients`` (not the home's: its owner closes it)."""
    own = {id(c): c for c in clients.clients if c is not clients.home}
    for client in own.values():
        await client.aclose()
