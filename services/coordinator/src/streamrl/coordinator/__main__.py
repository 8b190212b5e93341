"""``streamrl coordinator RECIPE [--coordinator.field=value ...]``: run the coordinator service.

Before the service starts, the recipe's ``rollout.engine.max_model_len`` (the most tokens a sample can
hold, prompt and response) bounds a training batch's size against Redis's largest argument
(``limits.py``): a run whose batches could never be published fails here with one line (exit 2).

The service object is built in a worker thread (:func:`asyncio.to_thread`): its blocking start-up -
reading and checking the datasets, loading the tokenizers, tokenizing the evaluation prompts,
``wandb.init`` - never stalls the event loop, which keeps the heartbeat and the leases renewed (a
start longer than the lease TTL would otherwise hand the run to a standby) and answers SIGTERM. A
dataset that cannot feed the run fails there with one error line (exit 2).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING

from streamrl.common.config import apply_overrides, load_config, read_recipe
from streamrl.common.errors import ConfigError
from streamrl.common.lifecycle import ServiceContext, parse_args, service_main
from streamrl.coordinator.config import CoordinatorConfig
from streamrl.coordinator.limits import batch_size_problem

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


def recipe_problem(argv: list[str]) -> str | None:
    """Why the recipe's batches could outgrow Redis (see the module docstring), or None - also when the
    recipe does not load: :func:`service_main` reports that."""
    args = parse_args("coordinator", argv, CoordinatorConfig)
    recipe = args.recipe or os.environ.get("STREAMRL_RECIPE")
    if args.check:
        return None
    try:
        config = load_config(CoordinatorConfig, recipe, args.overrides, section="coordinator")
        data = apply_overrides(read_recipe(recipe) if recipe else {}, args.overrides)
    except ConfigError:
        return None
    engine = data.get("rollout", {}).get("engine", {}) if isinstance(data.get("rollout"), dict) else {}
    tokens = engine.get("max_model_len") if isinstance(engine, dict) else None
    if not isinstance(tokens, int):
        return None
    return batch_size_problem(
        prompts_per_step=config.prompts_per_step,
        group_size=config.group_size,
        tokens=tokens,
        tokens_field="rollout.engine.max_model_len",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    problem = recipe_problem(argv)
    if problem:
        print(f"streamrl coordinator: {problem}", file=sys.stderr)
        return 2
    return service_main("coordinator", CoordinatorConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
