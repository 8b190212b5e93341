"""A rollout worker's seat in the weight relay (``learner.weights_transport = "relay"``): the Redis side.

The first ``relay`` event makes the worker's relay node (``rollout.weights_relay``), installs it as the
process's seat (:func:`streamrl.torchkit.weights.relay.install_seat`: the engine's relay receiver fetches into
it and it serves what it holds onward) and advertises it in the heartbeat (``weights_relay``). Before each
relay update, :meth:`WorkerRelay.plan` reads the live rollout heartbeats and tells the seat where to fetch that
version from (:func:`streamrl.rollout.weights.relay_sources.relay_upstreams`); the receiver adds the learner
last. Torch is imported only when a relay event comes.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

from streamrl.common.health import live_heartbeats_async
from streamrl.common.lifecycle import ServiceContext
from streamrl.common.messages import WeightsPublished
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.weights.relay_sources import Peer, relay_upstreams

if TYPE_CHECKING:
    from streamrl.torchkit.weights.relay import RelaySeat

logger = logging.getLogger(__name__)


class WorkerRelay:
    """See the module docstring."""

    def __init__(self, config: RolloutConfig, ctx: ServiceContext) -> None:
        self.cfg = config
        self.ctx = ctx
        self.seat: RelaySeat | None = None

    def _seat(self) -> RelaySeat:
        if self.seat is None:
            from streamrl.common.weights.relay import RelayNode
            from streamrl.torchkit.weights.relay import RelaySeat, install_seat

            relay = self.cfg.weights_relay
            advertise = relay.advertise_host or (
                relay.host if relay.host not in ("0.0.0.0", "") else socket.gethostname()
            )
            node = RelayNode(relay.host, relay.port, stall_s=self.cfg.relay_stall_s)
            self.seat = RelaySeat(node, advertise)
            install_seat(self.seat)
            self.ctx.weights_relay = self.seat.endpoint
            logger.info("relay node serving held weights at %s", self.seat.endpoint)
        return self.seat

    async def prepare(self, event: WeightsPublished) -> None:
        """Before ``event`` is loaded: on the relay transport, set where this worker fetches it from (logged);
        on any other transport nothing (its receiver needs no peers)."""
        if event.transport != "relay":
            return
        peers = await self.plan(event)
        logger.info("fetching version %d over the relay from %s", event.version, peers or "the learner")

    async def plan(self, event: WeightsPublished) -> list[str]:
        """Set where this worker fetches ``event``'s version from; returns those peers (``host:port``)."""
        seat = self._seat()
        beats = await live_heartbeats_async(self.ctx.bus.redis, self.ctx.names, "rollout")
        peers = [Peer(b.instance, b.weights_relay, b.policy_version) for b in beats]
        me = Peer(self.ctx.instance, seat.endpoint, self.ctx.policy_version)
        upstreams = relay_upstreams(me, peers, event.version, self.cfg.weights_relay.fanout)
        seat.plan(event.version, event.checksum, upstreams)
        return [f"{host}:{port}" for host, port in upstreams]

    def close(self) -> None:
        if self.seat is not None:
            from streamrl.torchkit.weights.relay import install_seat

            install_seat(None)
            self.seat.close()
            self.seat = None
