"""A minimal streamrl service for bus tests: trajectories -> scored (reward = response length).

Run as ``python bus_worker.py --redis.url=... --run_id=... --echo.delay_s=0.05``; it runs as the
service named by ``BUS_WORKER_SERVICE`` (default ``echo``; e.g. ``coordinator`` to test its lease).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from pydantic import Field

from streamrl.common.bus import Output
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.lifecycle import ServiceConfig, ServiceContext, service_main
from streamrl.common.messages import ScoredTrajectory, Trajectory


class EchoConfig(ServiceConfig):
    delay_s: float = Field(0.0, ge=0)
    """Time each message takes to handle (s)."""
    fail_ids: list[str] = []
    """Trajectory ids whose handling always raises."""
    start_blocking_s: float = Field(0.0, ge=0)
    """Start-up work that blocks the event loop this long (a dataset, tokenizer or model load) (s)."""
    start_blocking_until: str = ""
    """A file: start-up blocks the event loop until it exists (a start as slow as a test needs)."""
    crash_ids: list[str] = []
    """Trajectory ids whose handling kills the process at once (as an OOM kill or a segfault would)."""


async def run(config: EchoConfig, ctx: ServiceContext) -> None:
    time.sleep(config.start_blocking_s)  # blocking on purpose, as a slow start does
    while config.start_blocking_until and not os.path.exists(config.start_blocking_until):
        time.sleep(0.05)

    async def handle(msg: Trajectory) -> list[Output]:
        await asyncio.sleep(config.delay_s)
        if msg.id in config.crash_ids:
            os._exit(9)
        if msg.id in config.fail_ids:
            raise RuntimeError(f"scorer exploded on {msg.id}")
        scored = ScoredTrajectory(trajectory=msg, reward=float(len(msg.response_ids)), scorer="echo")
        return [Output(stream=ctx.names.scored, message=scored)]

    loop = ConsumerLoop(
        ctx.bus,
        ctx.names,
        stream=ctx.names.trajectories,
        group="reward",
        consumer=ctx.instance,
        handler=handle,
        message_type=Trajectory,
        config=config.consumer,
    )
    ctx.loops.append(loop)
    ctx.status = "running"
    await loop.run(ctx.stop, burst=ctx.burst)


if __name__ == "__main__":
    sys.exit(service_main(os.environ.get("BUS_WORKER_SERVICE", "echo"), EchoConfig, run))
