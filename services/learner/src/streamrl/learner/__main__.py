"""``streamrl learner RECIPE [--learner.field=value ...]``: run the RL learner service."""

from __future__ import annotations

import asyncio
import sys

from streamrl.common.lifecycle import ServiceContext, service_main
from streamrl.learner.config import LearnerConfig


async def _run(config: LearnerConfig, ctx: ServiceContext) -> None:
    from streamrl.learner.service import LearnerService
    from streamrl.learner.trainer import RLTrainer

    trainer = await asyncio.to_thread(RLTrainer, config)
    await LearnerService(config, ctx, trainer).run()


def main(argv: list[str] | None = None) -> int:
    return service_main("learner", LearnerConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
