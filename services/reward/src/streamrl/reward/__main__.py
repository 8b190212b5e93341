"""``streamrl reward RECIPE [--reward.field=value ...]``: run one reward worker.

While a permanent error pauses scoring (:mod:`streamrl.reward.pause`) its heartbeat says ``paused`` with the
cause. It exits with status 1 when a scorer can score nothing more (a sync reward function whose threads
all hang: :mod:`streamrl.reward.threads`), leaving what it held pending for its restart.
"""

from __future__ import annotations

import asyncio
import sys

from streamrl.common.aio import cancel_and_wait
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.lifecycle import ServiceConfig, ServiceContext, service_main
from streamrl.common.messages import Trajectory, TrajectoryRecord
from streamrl.reward.config import RewardConfig


class RewardServiceConfig(ServiceConfig, RewardConfig):
    """The ``[reward]`` section (scorers, micro-batching) plus the shared top-level fields."""


async def _run(config: RewardServiceConfig, ctx: ServiceContext) -> None:
    from streamrl.reward.service import RedisPayloads, RewardService

    assert config.redis.url is not None  # service_main refuses to start without one
    ctx.metrics.watch_streams(config.redis.url, {"trajectories": ctx.names.trajectories})
    payloads = RedisPayloads(ctx.bus.redis, ctx.bus.max_command_bytes)

    def paused(cause: str) -> None:  # the heartbeat says paused, with the cause ("" once it resumes)
        ctx.paused = cause

    service = RewardService(
        config,
        ctx.names,
        tracing=ctx.tracing,
        metrics=ctx.metrics,
        payloads=payloads,
        on_pause=paused,
    )
    loop: ConsumerLoop[TrajectoryRecord | Trajectory] = ConsumerLoop(
        ctx.bus,
        ctx.names,
        stream=ctx.names.trajectories,
        group="reward",
        consumer=ctx.instance,
        handler=service.handle,
        message_type=(TrajectoryRecord, Trajectory),
        config=config.consumer,
    )
    ctx.loops.append(loop)
    ctx.mark_running()

    async def stop_when_failed() -> None:
        await service.failed.wait()
        ctx.stop.set()
        await service.close()  # the calls still waiting are cancelled: their entries stay pending

    async def release_paused_when_stopping() -> None:
        await ctx.stop.wait()
        await service.stopping()

    watchers = [asyncio.create_task(stop_when_failed()), asyncio.create_task(release_paused_when_stopping())]
    try:
        await loop.run(ctx.stop, burst=ctx.burst)
    finally:
        await cancel_and_wait(watchers)
        await service.close()
    if service.failure is not None:
        raise RuntimeError(f"the reward worker stopped: {service.failure}")


def main(argv: list[str] | None = None) -> int:
    return service_main("reward", RewardServiceConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
