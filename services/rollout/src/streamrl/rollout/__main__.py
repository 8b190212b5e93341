"""``streamrl rollout RECIPE [--rollout.field=value ...]``: run one rollout worker."""

from __future__ import annotations

import asyncio
import sys

from streamrl.common.lifecycle import ServiceContext, service_main
from streamrl.rollout.config import RolloutConfig


async def _run(config: RolloutConfig, ctx: ServiceContext) -> None:
    from streamrl.rollout.engine import build_engine
    from streamrl.rollout.service import RolloutService

    assert config.redis.url is not None  # service_main refuses to start without one
    ctx.metrics.watch_streams(config.redis.url, {"prompts": ctx.names.prompts})
    engine = await asyncio.to_thread(build_engine, config.engine)
    await RolloutService(config, ctx, engine).run()


def main(argv: list[str] | None = None) -> int:
    return service_main("rollout", RolloutConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
