"""Where the coordinator's CPU goes per trajectory, from a cProfile of its whole run (bench/fleet.py --profile).

cProfile slows Python code down unevenly, so its seconds are scaled to the CPU time /proc measured for
the same process: ``ms per trajectory = cumulative s * (measured CPU s / profiled busy s) / trajectories``,
where the profiled busy time is everything but the event loop's idle wait (``epoll.poll``). Start-up
(imports, the tokenizer) is in both totals. The figures are cumulative: a function's callees are in
its own figure (``build`` contains ``samples``; ``issue`` contains ``_encode``), so they do not add up.
A coroutine's time counts only while it runs, not while it awaits Redis.
"""

from __future__ import annotations

import pstats
from pathlib import Path

FUNCTIONS = {
    ("common/consumer.py", "_process"): "scored entry: decode, handle_scored (re-encode), commit (HSET + XACK)",
    ("common/bus.py", "_flush"): "commit script calls (CommitBatcher)",
    ("coordinator/groups.py", "complete"): "groups.complete: HLEN/SISMEMBER per touched group, move to ready",
    ("coordinator/batches.py", "build"): "batches.build: read + decode the groups, encode + XADD the manifest",
    ("coordinator/groups.py", "stored"): "groups.stored: HGETALL + decode of a batch's samples",
    ("coordinator/issuing.py", "issue"): "issuing.issue: admission, build + XADD PromptWorkItems",
    ("coordinator/prompts.py", "_encode"): "prompts._encode: tokenize a prompt (once per epoch)",
    ("coordinator/groups.py", "time_out"): "groups.time_out: every in-flight group each second",
    ("coordinator/service.py", "_record_batch"): "per-batch metrics and logging",
    ("coordinator/metrics.py", "plot"): "the PNG plot",
    ("common/codec.py", "decode"): "codec.decode (all messages)",
    ("common/codec.py", "encode"): "codec.encode (all messages)",
}
IDLE = ("~", 0, "<method 'poll' of 'select.epoll' objects>")


def coordinator_split(profile: Path, cpu_s: float, trajectories: int) -> dict[str, object]:
    """ms of coordinator CPU per trajectory stored, per function of :data:`FUNCTIONS` (see the module docstring)."""
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    total = sum(tt for _, _, tt, _, _ in stats.values())
    idle = stats.get(IDLE, (0, 0, 0.0, 0.0, {}))[2]
    scale = cpu_s / max(total - idle, 1e-9)
    split: dict[str, float] = {}
    for (filename, _, name), (_, _, _, cumulative, _) in stats.items():
        for (suffix, function), label in FUNCTIONS.items():
            if name == function and filename.endswith(suffix):
                split[label] = round(1e3 * cumulative * scale / max(trajectories, 1), 3)
    return {
        "where": "the coordinator process (streamrl.coordinator.service and what it calls)",
        "cpu_s": round(cpu_s, 2),
        "trajectories": trajectories,
        "profile_scale": round(scale, 3),
        "ms_per_trajectory": dict(sorted(split.items(), key=lambda kv: -kv[1])),
    }
