"""What bench/fleet.py reads while a step runs: CPU time and memory of processes (/proc), and of Redis
the consumer groups' backlogs, per-command statistics, the slow log, and the cost of one round trip.

``read_groups`` also trims what every group consumed (``XTRIM MINID``), as a retention job would.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import fleet_model as fm
import redis as syncredis

from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer

GROUPS = {"prompts": "rollout", "trajectories": "reward", "scored": "coordinator", "batches": "learner"}
"""Each stream and the consumer group that works it."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
SLOWLOG_LEN = 10_000
"""Slow-log entries kept per step (commands over 10 ms, Redis' default threshold)."""


def cpu_ticks(pids: dict[str, int], last: dict[str, int]) -> dict[str, int]:
    """CPU ticks so far of each process (a process that ended keeps its last reading)."""
    out = dict(last)
    for name, pid in pids.items():
        try:
            out[name] = fm.process_ticks(Path(f"/proc/{pid}/stat").read_text())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def next_id(entry_id: str) -> str:
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) + 1}"


def id_order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def read_groups(client: syncredis.Redis, names: StreamNames) -> dict[str, dict[str, int]]:
    """Per stream: its group's backlog (undelivered + pending) and entries handled (read - pending);
    trims what the group consumed."""
    out: dict[str, dict[str, int]] = {}
    for stream, group in GROUPS.items():
        key = getattr(names, stream)
        if not client.exists(key):
            out[stream] = {"backlog": 0, "handled": 0, "added": 0}
            continue
        info = next((g for g in client.xinfo_groups(key) if text(g["name"]) == group), None)
        if info is None:
            out[stream] = {"backlog": 0, "handled": 0, "added": 0}
            continue
        # lag (Redis 7) = entries added - entries read; valid here: trimming leaves no tombstones (XDEL would)
        if info["lag"] is None:
            raise RuntimeError(f"redis cannot tell the lag of group {group} on {stream}: {info}")
        read, pending, lag = int(info["entries-read"] or 0), int(info["pending"]), int(info["lag"])  # None: none read
        out[stream] = {"backlog": lag + pending, "handled": read - pending, "added": read + lag}
        summary = client.xpending(key, group)
        keep = text(summary["min"]) if summary["pending"] else next_id(text(info["last-delivered-id"]))
        if id_order(keep) > (0, 0):
            client.xtrim(key, minid=keep, approximate=True)
    return out


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def slow_commands(client: syncredis.Redis, since: float) -> dict[str, dict[str, float]]:
    """Commands that held Redis (single-threaded: every client waited) for over 10 ms since ``since``, by name."""
    out: dict[str, dict[str, float]] = {}
    for entry in client.slowlog_get(SLOWLOG_LEN):
        if entry["start_time"] < since:
            continue
        name = bytes(entry["command"]).split(b" ", 1)[0].decode("ascii", "replace").lower()
        row = out.setdefault(name, {"count": 0, "max_ms": 0.0, "total_ms": 0.0})
        row["count"] += 1
        row["max_ms"] = max(row["max_ms"], entry["duration"] / 1e3)
        row["total_ms"] = round(row["total_ms"] + entry["duration"] / 1e3, 1)
    return out


def command_latencies(client: syncredis.Redis) -> dict[str, dict[str, float]]:
    """Per command: its p50 / p99 / p99.9 time inside Redis (ms) since the last ``CONFIG RESETSTAT`` (Redis 7's
    latency tracking, ``INFO latencystats``; a command's time as SLOWLOG counts it, waiting clients excluded)."""
    stats = client.info("latencystats").items()
    return {
        name.removeprefix("latency_percentiles_usec_"): {p: round(v / 1e3, 3) for p, v in row.items()}
        for name, row in stats
    }


def command_stats(client: syncredis.Redis) -> dict[str, tuple[int, int]]:
    """Per command: (calls, microseconds inside it) so far."""
    stats = client.info("commandstats").items()
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats}


def round_trip_cost(folder: Path, requests: int = 100_000) -> dict[str, float]:
    """Redis CPU per small command sent alone (``EXISTS``, one round trip each, 50 connections of
    ``redis-benchmark``) on a fresh server: what each of a consumer's one-key-at-a-time calls costs it."""
    server = RedisServer(folder, appendonly=False).start()
    assert server.proc is not None
    stat = Path(f"/proc/{server.proc.pid}/stat")
    try:
        before, started = fm.process_ticks(stat.read_text()), time.monotonic()
        cmd = ["redis-benchmark", "-p", str(server.port), "-q", "-n", str(requests), "-c", "50", "EXISTS", "k"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
        cpu_s, wall_s = (fm.process_ticks(stat.read_text()) - before) / CLK_TCK, time.monotonic() - started
    finally:
        server.stop()
    rate = re.findall(r"([\d.]+) requests per second", out.replace(",", ""))
    return {
        "requests_per_s": float(rate[-1]) if rate else requests / wall_s,
        "redis_us_per_request": round(1e6 * cpu_s / requests, 2),
        "redis_cores": round(cpu_s / wall_s, 2),
    }
