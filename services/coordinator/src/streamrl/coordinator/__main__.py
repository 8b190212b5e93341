"""``streamrl coordinator RECIPE [--coordinator.field=value ...]``: run the coordinator service."""

from __future__ import annotations

import sys

from streamrl.common.lifecycle import ServiceContext, service_main
from streamrl.coordinator.config import CoordinatorConfig


async def _run(config: CoordinatorConfig, ctx: ServiceContext) -> None:
    from streamrl.coordinator.service import CoordinatorService

    await CoordinatorService(config, ctx).run()


def main(argv: list[str] | None = None) -> int:
    return service_main("coordinator", CoordinatorConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
