"""The end of every fault scenario: wait for the run, count it, record its row, check the invariants.

:func:`conclude` records the row before it asserts anything, so the table printed at the end of
the session (tests/faults/conftest.py) and written by bench/faults.py shows failed scenarios too,
with what was counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from accounting import Counts, count_run
from harness import FaultRun

ROWS: list[Row] = []
"""Every row recorded in this session, in order."""


@dataclass
class Row:
    """One scenario's outcome."""

    scenario: str
    completed: bool
    total_steps: int
    counts: Counts
    recovery_bound_s: float | None
    unexpected_exits: list[str]
    wall_s: float
    failures: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    """What the scenario adds (the proxy's lost replies by kind, the write points seen, ...)."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("counts"))
        return out


def conclude(
    run: FaultRun,
    scenario: str,
    *,
    total_steps: int,
    group_size: int = 4,
    fault_end: float | None,
    recovery_bound_s: float | None,
    run_timeout_s: float = 180.0,
    allowed_exits: tuple[str, ...] = (),
    checks: Callable[[], list[str]] | None = None,
    stall_s: float = 45.0,
) -> Row:
    """Wait for ``run`` to complete, stop it, count it, record the row; then assert the invariants.

    ``allowed_exits``: services whose non-zero exit the design requires in this scenario.
    ``checks``: the scenario's own checks on the finished run (each failure one line).
    ``stall_s``: the run is wedged when nothing moved for this long (a restart that loads models
    takes longer than the default on a busy machine).
    """
    completed = run.wait_done(run_timeout_s, stall_s=stall_s)
    if not completed:
        run.dump_stacks()
    return record(run, scenario, completed, total_steps, group_size, fault_end, recovery_bound_s, allowed_exits, checks)


def record(
    run: FaultRun,
    scenario: str,
    completed: bool,
    total_steps: int,
    group_size: int,
    fault_end: float | None,
    recovery_bound_s: float | None,
    allowed_exits: tuple[str, ...] = (),
    checks: Callable[[], list[str]] | None = None,
    early_stop: str = "",
) -> Row:
    """Stop ``run``, count it and record its row; then assert the invariants (see :func:`conclude`)."""
    run.stop_services()
    run.concluded = True
    for tap in run.taps:
        tap.stop()
    counts = count_run(
        run.client,
        run.names,
        group_size=group_size,
        weights_key=run.weights_key,
        injected=run.injected,
        fault_end=fault_end,
        entries=run.entries,
        lanes=run.lane_sides,
    )
    exits = [str(e) for e in run.exits]
    row = Row(scenario, completed, total_steps, counts, recovery_bound_s, exits, round(time.time() - run.started_at, 1))
    scenario_failures = checks() if checks else []
    row.details = dict(run.details)
    if run.proxy is not None:
        row.details["lost_replies"] = run.proxy.lost_by_kind()
        row.details["writes_seen"] = run.proxy.writes_by_service()
    row.failures = (
        ([early_stop] if early_stop else [])
        + _check(row, run, allowed_exits)
        + [m for tap in run.taps for m in tap.missed()]
    )
    row.failures += scenario_failures
    ROWS.append(row)
    assert not row.failures, f"{scenario}: " + "; ".join(row.failures + counts.notes)
    return row


def _check(row: Row, run: FaultRun, allowed_exits: tuple[str, ...]) -> list[str]:
    c = row.counts
    failed = []
    if not row.completed:
        failed.append(f"the run did not complete ({run.describe()})")
    if c.lost:
        failed.append(f"lost {c.lost} groups")
    if c.over_counted:
        failed.append(f"{c.over_counted} groups counted as dropped beyond those neither trained nor dead-lettered")
    if c.trained_twice:
        failed.append(f"{c.trained_twice} trajectories trained twice")
    if c.versions_reused:
        failed.append(f"{c.versions_reused} policy versions published with different weights")
    if c.pending_end:
        failed.append(f"{c.pending_end} entries/groups pending at the end")
    if c.steps < row.total_steps:
        failed.append(f"reached step {c.steps} of {row.total_steps}")
    if c.eval_rounds_open:
        failed.append(f"{c.eval_rounds_open} evaluation rounds never closed")
    if row.recovery_bound_s is not None:
        if c.recovery_s is None:
            failed.append("no batch trained after the fault")
        elif c.recovery_s > row.recovery_bound_s:
            failed.append(f"recovery took {c.recovery_s} s (bound {row.recovery_bound_s} s)")
    bad_exits = [e for e in run.exits if e.instance.rsplit("-", 1)[0] not in allowed_exits]
    if bad_exits:
        failed.append(f"{len(bad_exits)} unexpected service exits: " + " || ".join(str(e) for e in bad_exits[:4]))
    return failed


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table."""
    head = [
        "scenario",
        "issued",
        "trained",
        "dropped (reason: groups)",
        "lost",
        "twice",
        "pending",
        "steps",
        "recovery s",
        "exits",
        "wall s",
        "result",
    ]
    lines = [head]
    for r in rows:
        c = r.counts
        dropped = ", ".join(f"{k}: {v}" for k, v in sorted(c.dropped.items())) or "-"
        bound = f" (<={r.recovery_bound_s:g})" if r.recovery_bound_s is not None else ""
        recovery = ("-" if c.recovery_s is None else f"{c.recovery_s:g}") + bound
        lines.append(
            [
                r.scenario,
                str(c.issued),
                str(c.trained),
                dropped,
                str(c.lost),
                str(c.trained_twice),
                str(c.pending_end),
                f"{c.steps}/{r.total_steps}",
                recovery,
                str(len(r.unexpected_exits)),
                f"{r.wall_s:g}",
                "ok" if not r.failures else "FAIL",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r.failures:
            text.append(f"FAIL {r.scenario}: " + "; ".join(r.failures + r.counts.notes))
    for r in rows:
        lost = r.details.get("lost_replies")
        if lost:
            text.append(f"{r.scenario}: replies lost: " + ", ".join(f"{k} x{n}" for k, n in sorted(lost.items())))
    return "\n".join(text)
