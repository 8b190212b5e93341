"""``streamrl <command> ...``: one umbrella command; each package registers its subcommands.

Subcommands are entry points in the ``streamrl.commands`` group (``name = "module:function"``,
the function takes ``argv: list[str]`` and returns an exit code), so ``streamrl.ops`` never
imports a service.

``streamrl up RECIPE [overrides] --dry-run`` validates the launch recipe and asks each service it
would start for its resolved config (``streamrl <service> RECIPE [overrides] --dry-run``, one
process each, in parallel), prints them as one JSON object (``{"up": ..., "coordinator": ...}``,
secrets masked) and exits: 0 when every service accepts the recipe, 2 otherwise (each refusal on
stderr). Nothing is started and nothing is written. With lanes (``lanes.count > 1``) each lane's coordinator,
rollout and reward are asked with their ``STREAMRL_LANE`` (keys ``coordinator-lane0``, ...), and ``processes``
lists every replica ``streamrl up`` would start (name, service, lane, environment) and ``redis`` what it would
start of Redis (:mod:`streamrl.ops.lane_plan`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from typing import Any


def commands() -> dict[str, str]:
    """Registered subcommands: name -> ``module:function``."""
    return {ep.name: ep.value for ep in entry_points(group="streamrl.commands")}


def split_dry_run(argv: list[str]) -> tuple[str, list[str]]:
    """``(recipe, overrides)`` of ``streamrl up`` arguments with ``--dry-run`` removed."""
    rest = [a for a in argv if a != "--dry-run"]
    positional = [a for a in rest if not a.startswith("-")]
    if len(positional) != 1:
        raise ValueError(f"streamrl up --dry-run takes one recipe and --section.field=value overrides, got {rest}")
    recipe = positional[0]
    return recipe, [a for a in rest if a != recipe]


def up_dry_run(argv: list[str]) -> int:
    """``streamrl up ... --dry-run``: print the launch config and every service's resolved config."""
    from streamrl.common.config import ConfigError, apply_overrides, read_recipe, validate
    from streamrl.common.redact import redact
    from streamrl.ops.lane_plan import embedded_servers, plan_processes, split_unit, unit_env, units
    from streamrl.ops.up_config import SERVICES, LaunchRecipe

    try:
        recipe, overrides = split_dry_run(argv)
        data = apply_overrides(read_recipe(recipe), overrides)
        launch = validate(LaunchRecipe, data, source=f"recipe {recipe}")
        unknown = [s for s in launch.up.services if s not in SERVICES]
        if unknown:
            raise ConfigError(f"up.services: unknown service(s) {unknown}; known: {list(SERVICES)}")
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"streamrl up: {e}", file=sys.stderr)
        return 2
    resolved: dict[str, Any] = {"up": redact(launch.model_dump(mode="json"))}
    lanes = launch.lanes.count
    if lanes > 1:
        servers = embedded_servers(lanes, (data.get("redis") or {}).get("url"), launch.lanes.urls)
        resolved["redis"] = (
            f"{servers} embedded redis-servers, one per lane (lane 0's also the home)" if servers else "external"
        )
        resolved["processes"] = [vars(p) for p in plan_processes(launch.up.services, launch.up.replicas, lanes)]
    procs = {}
    for unit in units(launch.up.services, lanes):
        command = [sys.executable, "-m", "streamrl.ops.cli", split_unit(unit)[0], recipe, *overrides, "--dry-run"]
        env = {**os.environ, **unit_env(unit)}
        procs[unit] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    code = 0
    for service, proc in procs.items():
        out, err = proc.communicate()
        if proc.returncode != 0:
            print(
                f"streamrl up: {service} refuses the recipe (exit {proc.returncode}):\n{err.strip()}", file=sys.stderr
            )
            code = 2
            continue
        resolved[service] = json.loads(out)
    print(json.dumps(resolved, indent=2))
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    available = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: streamrl <command> [args...]\n\ncommands:")
        for name in sorted(available):
            print(f"  {name}")
        print("\n`streamrl <command> --help` lists its options and every config field; all: docs/configuration.md")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "up" and "--dry-run" in rest:
        return up_dry_run(rest)
    if name not in available:
        print(f"streamrl: unknown command {name!r}; known: {', '.join(sorted(available))}", file=sys.stderr)
        return 2
    (ep,) = [ep for ep in entry_points(group="streamrl.commands") if ep.name == name]
    return int(ep.load()(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
