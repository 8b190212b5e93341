"""``streamrl scale RUN service=N [service=M ...]``: change the replica counts of a live run.

    streamrl scale recipes/demo.toml rollout=3
    streamrl scale runs/demo rollout=4 reward=2

RUN is the run's recipe (its ``redis.url``, else the ``up.json`` that ``streamrl up`` wrote in its
``run_dir``) or the run directory itself. The counts go into the run's replicas hash
(:func:`streamrl.ops.scaling.request_replicas`); the run's launcher starts or drains replicas
within ``up.reconcile_interval_s``. Prints what was asked, the desired counts, and the live ones. In a run
with lanes (``lanes.count > 1``) the counts are per lane: ``rollout=3`` is three rollout replicas in each lane,
``rollout-lane1=5`` five in lane 1 alone (until ``rollout=N`` is asked again); the live replicas are read from
each lane's Redis, per lane.

    streamrl scale runs/demo rollout-lane1=5
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import redis as syncredis

from streamrl.common.config import apply_overrides, read_recipe, validate
from streamrl.common.errors import ConfigError
from streamrl.common.health import live_heartbeats
from streamrl.common.lanes import lane_names
from streamrl.common.run_info import read_run_info
from streamrl.common.streams import StreamNames
from streamrl.ops.lane_plan import unit_name
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


@dataclass(frozen=True)
class Run:
    """Where a live run is: its id, home Redis URL, scaling bounds, lanes and each lane's URL (empty: the home's)."""

    run_id: str
    url: str
    max_replicas: dict[str, int]
    lanes: int = 1
    lane_urls: tuple[str, ...] = ()

    def lane_url(self, lane: int) -> str:
        return self.lane_urls[lane] if self.lane_urls else self.url


def find_run(run: str) -> Run:
    """Where RUN (a recipe or a run directory) is."""
    if Path(run).is_dir():
        info = read_run_info(run)
        return Run(info.run_id, info.url(), info.max_replicas, info.lanes, tuple(info.lane_url_list()))
    data = apply_overrides(read_recipe(run), [])
    recipe = validate(LaunchRecipe, data, source=f"recipe {run}")
    url = (data.get("redis") or {}).get("url")
    if not url:  # an embedded redis-server: its URL is in the run directory
        info = read_run_info(recipe.run_dir)
        return Run(info.run_id, info.url(), dict(recipe.up.max_replicas), info.lanes, tuple(info.lane_url_list()))
    return Run(recipe.run_id, url, dict(recipe.up.max_replicas), recipe.lanes.count, tuple(recipe.lanes.urls))


def live_replicas(run: Run) -> dict[str, list[str]]:
    """The live instances of each scalable unit (each service; with lanes each lane's, from the lane's Redis)."""
    live: dict[str, list[str]] = {}
    for k in range(run.lanes) if run.lanes > 1 else [None]:
        names = StreamNames(run.run_id) if k is None else lane_names(run.run_id, k)
        client = syncredis.Redis.from_url(run.url if k is None else run.lane_url(k), socket_timeout=5)
        try:
            beats = live_heartbeats(client, names)
        finally:
            client.close()
        for service in SCALABLE:
            live[unit_name(service, k)] = sorted(b.instance for b in beats if b.service == service)
    return live


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamrl scale", description="Change the replica counts of a live run.")
    parser.add_argument("run", help="the run's recipe, or its run directory (holding up.json)")
    parser.add_argument(
        "counts",
        nargs="+",
        metavar="service=N",
        help=f"new replica count; services: {SCALABLE}; with lanes per lane, or one lane's: rollout-lane1=N",
    )
    args = parser.parse_args(argv)
    try:
        counts = parse_counts(args.counts)
        run = find_run(args.run)
        names = StreamNames(run.run_id)
        client = syncredis.Redis.from_url(run.url, socket_timeout=5)
        request_replicas(client, names, counts, max_replicas=run.max_replicas, lanes=run.lanes)
        desired = desired_replicas(client, names)
        client.close()
        live = live_replicas(run)
    except ValueError as e:  # ConfigError too
        print(f"streamrl scale: {e}", file=sys.stderr)
        return 2
    except (syncredis.RedisError, OSError) as e:
        print(f"streamrl scale: cannot reach the run's redis: {e}", file=sys.stderr)
        return 1
    print("requested: " + " ".join(f"{s}={n}" for s, n in counts.items()))
    print("desired:   " + " ".join(f"{s}={n}" for s, n in sorted(desired.items())))
    print("live now:  " + " ".join(f"{u}={len(v)} ({', '.join(v) or '-'})" for u, v in live.items()))
    return 0
