"""``streamrl scale RUN service=N [service=M ...]``: change the replica counts of a live run.

    streamrl scale recipes/demo.toml rollout=3
    streamrl scale runs/demo rollout=4 reward=2

RUN is the run's recipe (its ``redis.url``, else the ``up.json`` that ``streamrl up`` wrote in its
``run_dir``) or the run directory itself. The counts go into the run's replicas hash
(:func:`streamrl.ops.scaling.request_replicas`); the run's launcher starts or drains replicas
within ``up.reconcile_interval_s``. Prints what was asked, the desired counts, and the live ones. In a run
with lanes (``lanes.count > 1``) the counts are per lane: ``rollout=3`` is three rollout replicas in each lane.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import redis as syncredis

from streamrl.common.config import apply_overrides, read_recipe, validate
from streamrl.common.errors import ConfigError
from streamrl.common.health import live_heartbeats
from streamrl.common.run_info import read_run_info
from streamrl.common.streams import StreamNames
from streamrl.ops.scaling import SCALABLE, desired_replicas, request_replicas
from streamrl.ops.up_config import LaunchRecipe


def parse_counts(items: list[str]) -> dict[str, int]:
    """``["rollout=3", "reward=2"]`` -> ``{"rollout": 3, "reward": 2}``."""
    counts: dict[str, int] = {}
    for item in items:
        service, sep, raw = item.partition("=")
        if not sep or not raw.strip().isdigit():
            raise ConfigError(f"{item!r}: expected service=N with N a whole number >= 0, e.g. rollout=3")
        counts[service.strip()] = int(raw)
    return counts


def find_run(run: str) -> tuple[str, str, dict[str, int]]:
    """The run id, Redis URL and ``up.max_replicas`` of RUN (a recipe or a run directory)."""
    if Path(run).is_dir():
        info = read_run_info(run)
        return info.run_id, info.url(), info.max_replicas
    data = apply_overrides(read_recipe(run), [])
    recipe = validate(LaunchRecipe, data, source=f"recipe {run}")
    url = (data.get("redis") or {}).get("url")
    if not url:  # an embedded redis-server: its URL is in the run directory
        info = read_run_info(recipe.run_dir)
        url = info.url()
    return recipe.run_id, url, dict(recipe.up.max_replicas)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamrl scale", description="Change the replica counts of a live run.")
    parser.add_argument("run", help="the run's recipe, or its run directory (holding up.json)")
    parser.add_argument("counts", nargs="+", metavar="service=N", help=f"new replica count; services: {SCALABLE}")
    args = parser.parse_args(argv)
    try:
        counts = parse_counts(args.counts)
        run_id, url, max_replicas = find_run(args.run)
        names = StreamNames(run_id)
        client = syncredis.Redis.from_url(url, socket_timeout=5)
        request_replicas(client, names, counts, max_replicas=max_replicas)
        desired = desired_replicas(client, names)
        beats = live_heartbeats(client, names)
        client.close()
    except ValueError as e:  # ConfigError too
        print(f"streamrl scale: {e}", file=sys.stderr)
        return 2
    except (syncredis.RedisError, OSError) as e:
        print(f"streamrl scale: cannot reach the run's redis: {e}", file=sys.stderr)
        return 1
    print("requested: " + " ".join(f"{s}={n}" for s, n in counts.items()))
    print("desired:   " + " ".join(f"{s}={n}" for s, n in sorted(desired.items())))
    live = {s: sorted(b.instance for b in beats if b.service == s) for s in SCALABLE}
    print("live now:  " + " ".join(f"{s}={len(v)} ({', '.join(v) or '-'})" for s, v in live.items()))
    return 0
