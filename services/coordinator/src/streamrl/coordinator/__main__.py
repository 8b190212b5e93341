"""``streamrl coordinator RECIPE [--coordinator.field=value ...]``: run the coordinator service.

The service object is built in a worker thread (:func:`asyncio.to_thread`): its blocking start-up -
reading and checking the datasets, loading the tokenizers, tokenizing the evaluation prompts,
``wandb.init`` - never stalls the event loop, which keeps the heartbeat and the leases renewed (a
start longer than the lease TTL would otherwise hand the run to a standby) and answers SIGTERM. A
dataset that cannot feed the run fails there with one error line (exit 2).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import TYPE_CHECKING

from streamrl.common.errors import ConfigError
from streamrl.common.lifecycle import ServiceContext, service_main
from streamrl.coordinator.config import CoordinatorConfig

if TYPE_CHECKING:
    from streamrl.coordinator.service import CoordinatorService

logger = logging.getLogger("streamrl.coordinator")


def _build(config: CoordinatorConfig, ctx: ServiceContext) -> CoordinatorService:
    """The service object, with its imports: all of it blocking work (run in a worker thread)."""
    from streamrl.coordinator.service import CoordinatorService

    return CoordinatorService(config, ctx)


async def _run(config: CoordinatorConfig, ctx: ServiceContext) -> None:
    try:
        service = await asyncio.to_thread(_build, config, ctx)
    except ConfigError as e:
        logger.error("coordinator: %s", e)
        raise SystemExit(2) from None
    await service.run()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return service_main("coordinator", CoordinatorConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
