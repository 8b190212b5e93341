"""Command entries of the offline jobs: ``streamrl sft|rm|dpo RECIPE [--section.field=value ...]``.

Each parses the recipe plus overrides into its config class (bad config fails here, naming the
field), prints the resolved config, saves it to ``train.run_dir/config.<job>.json`` and runs the
job. Heavy imports (torch, DeepSpeed) happen only after the config is valid.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from streamrl.common.config import load_config, save_resolved
from streamrl.common.config_docs import config_help, field_docs
from streamrl.common.errors import ConfigError
from streamrl.common.redact import redact
from streamrl.learner.offline.config import DPOConfig, RMConfig, SFTConfig

C = TypeVar("C", SFTConfig, RMConfig, DPOConfig)


def _main(argv: list[str], cls: type[C], job: str, runner: str) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(
            f"usage: streamrl {job} RECIPE.toml [--section.field=value ...]\n\nconfig fields (all commands: docs/configuration.md):"
        )
        print(config_help(field_docs(cls)))
        return 0 if argv else 2
    try:
        cfg = load_config(cls, argv[0], argv[1:])
    except ConfigError as e:
        print(f"streamrl {job}: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(redact(cfg.model_dump(mode="json")), indent=2))
        save_resolved(cfg, cfg.train.run_dir, job)
    module, _, func = runner.partition(":")
    run: Callable[[C], Any] = getattr(importlib.import_module(module), func)
    result = run(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        summary = {"job": job, "final_dir": str(result.final_dir), "best": result.best}
        if result.evals:
            summary["final_eval"] = result.evals[-1]
        print(json.dumps(summary))
    return 0


def sft_main(argv: list[str]) -> int:
    """``streamrl sft RECIPE [--key=value ...]``."""
    return _main(argv, SFTConfig, "sft", "streamrl.learner.offline.sft:run_sft")


def rm_main(argv: list[str]) -> int:
    """``streamrl rm RECIPE [--key=value ...]``."""
    return _main(argv, RMConfig, "rm", "streamrl.learner.offline.rm:run_rm")


def dpo_main(argv: list[str]) -> int:
    """``streamrl dpo RECIPE [--key=value ...]``."""
    return _main(argv, DPOConfig, "dpo", "streamrl.learner.offline.dpo:run_dpo")
