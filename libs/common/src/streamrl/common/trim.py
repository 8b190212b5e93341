"""Trimming a stream by consumption: keep what any of its consumer groups still needs, drop the rest.

For a stream read by consumer groups, the oldest entry still needed is, over its groups, the minimum
of each group's oldest pending entry (handed out, not acknowledged) and the entry after its
last-delivered id (not read yet). Everything older was handled by every group and goes, with
``XTRIM MINID ~`` (whole macro nodes only: cheap). ``redis.retain_consumed_s`` keeps consumed entries
younger than that too (tools reading the streams, the fault suite's accounting, debugging); a
stream with no group yet is left alone (its entries wait for their first reader). ``redis.maxlen``
stays the hard cap. The consumer loop runs it with its reclaim round: one XINFO GROUPS plus one
XPENDING summary per group with pending entries.
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis

logger = logging.getLogger(__name__)


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """``"ms-seq"`` as a pair of ints."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def next_id(entry_id: tuple[int, int]) -> tuple[int, int]:
    return entry_id[0], entry_id[1] + 1


def oldest_needed(groups: list[tuple[tuple[int, int], tuple[int, int] | None]]) -> tuple[int, int] | None:
    """The oldest id any group still needs, from each group's (last-delivered id, oldest pending id or
    None); None when there is no group (nothing may be trimmed)."""
    if not groups:
        return None
    return min(pending if pending is not None else next_id(last) for last, pending in groups)


def trim_point(needed: tuple[int, int] | None, now_ms: int, retain_s: float) -> tuple[int, int] | None:
    """The MINID to trim to: what the groups need, and nothing younger than ``retain_s``."""
    if needed is None:
        return None
    keep_from = (max(0, now_ms - int(retain_s * 1000)), 0)
    return min(needed, keep_from)


async def trim_consumed(redis: aioredis.Redis, stream: str, retain_s: float) -> int:
    """Trim ``stream`` to what its groups still need (see the module docstring): entries removed."""
    infos: list[dict[str, Any]] = await redis.xinfo_groups(stream)
    groups = []
    for info in infos:
        last = parse_id(info["last-delivered-id"])
        oldest = None
        if int(info["pending"]):
            summary = await redis.xpending(stream, info["name"])
            oldest = parse_id(summary["min"]) if summary.get("min") else None
        groups.append((last, oldest))
    seconds, micros = await redis.time()
    point = trim_point(oldest_needed(groups), int(seconds) * 1000 + int(micros) // 1000, retain_s)
    if point is None or point <= (0, 1):
        return 0
    removed = int(
        await redis.xtrim(stream, minid=f"{point[0]}-{point[1]}", approximate=True, limit=0)
    )  # LIMIT 0: no cap (the default stops at ~10,000 entries a call)
    if removed:
        logger.debug("%s: trimmed %d consumed entries (before %d-%d)", stream, removed, *point)
    return removed
