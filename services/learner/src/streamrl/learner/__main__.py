"""``streamrl learner RECIPE [--learner.field=value ...]``: run the RL learner service.

With ``learner.ranks = N > 1`` (and no launcher's ``RANK`` in the environment) this process starts
the N ranks of a learner group (:func:`streamrl.learner.rl.group.launch`) and waits for them. Rank 0
runs the service; the other ranks follow it (:meth:`LearnerGroup.follow`) and never touch the bus.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.common.config import load_config
from streamrl.common.errors import ConfigError
from streamrl.common.lifecycle import ServiceContext, parse_args, service_main
from streamrl.common.log import setup_logging
from streamrl.learner.rl.config import LearnerConfig

if TYPE_CHECKING:  # imported where used: they import torch
    from streamrl.learner.rl.group import LearnerGroup
    from streamrl.learner.rl.trainer import RLTrainer


def _group(config: LearnerConfig) -> tuple[RLTrainer, LearnerGroup]:
    from streamrl.learner.rl.group import LearnerGroup
    from streamrl.learner.rl.trainer import RLTrainer

    trainer = RLTrainer(config)
    return trainer, LearnerGroup(trainer, Path(config.run_dir) / "checkpoints", config.checkpoint_keep_last)


async def _run(config: LearnerConfig, ctx: ServiceContext) -> None:
    from streamrl.learner.rl.service import LearnerService

    trainer, group = await asyncio.to_thread(_group, config)
    await LearnerService(config, ctx, trainer, group).run()


def _follow(argv: list[str]) -> int:
    """A rank > 0 of the group: build the same trainer and do what rank 0 says until it stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every rank: rank 0 decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = parse_args("learner", argv)
    config = load_config(
        LearnerConfig, args.recipe or os.environ.get("STREAMRL_RECIPE"), args.overrides, section="learner"
    )
    setup_logging("learner", f"{args.instance or 'learner'}-rank{os.environ['RANK']}")
    _, group = _group(config)
    group.follow()
    return 0


def _configured_ranks(argv: list[str]) -> int:
    args = parse_args("learner", argv, LearnerConfig)
    if args.check or args.dry_run:
        return 1
    try:
        config = load_config(
            LearnerConfig, args.recipe or os.environ.get("STREAMRL_RECIPE"), args.overrides, section="learner"
        )
    except ConfigError:
        return 1  # service_main reports it
    return config.ranks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "RANK" not in os.environ:
        ranks = _configured_ranks(argv)
        if ranks > 1:
            from streamrl.learner.rl.group import launch

            logging.basicConfig(level=logging.INFO, format="%(asctime)s learner-group %(message)s")
            return launch(ranks, argv)
    if int(os.environ.get("RANK", "0")) > 0:
        return _follow(argv)
    return service_main("learner", LearnerConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
