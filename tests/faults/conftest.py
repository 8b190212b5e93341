"""Fixtures of the fault-injection suite, and the table of its rows at the end of the session.

The table (one row per scenario: issued, trained, dropped by reason, lost, trained twice, pending,
steps, recovery) is printed in the terminal summary of any pytest run that ran a scenario. With
``STREAMRL_FAULTS_ROWS=/path.json`` the rows are also written there as JSON (bench/faults.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import FaultRun, MakeRun
from scenario import ROWS, format_table, record

ROWS_ENV = "STREAMRL_FAULTS_ROWS"


@pytest.fixture
def fault_run(tiny_task: Path, tmp_path: Path) -> Iterator[MakeRun]:
    """``fault_run(name, overrides=[...], env={...})``: a run of the real services on the tiny task,
    not started yet; every run made is closed (no process left) when the test ends."""
    made: list[FaultRun] = []

    def make(
        name: str, overrides: list[str] | None = None, env: dict[str, str] | None = None, **options: Any
    ) -> FaultRun:
        run = FaultRun(
            name, tiny_task, tmp_path / name, overrides=list(overrides or []), env=dict(env or {}), **options
        )
        made.append(run)
        return run

    yield make
    for run in made:
        if run.started_at and not run.concluded:  # it failed before its end: still a row in the table
            try:
                record(
                    run,
                    run.name,
                    False,
                    run.total_steps,
                    run.group_size,
                    None,
                    None,
                    early_stop="the scenario stopped before the end of the run (see its error)",
                )
            except AssertionError:
                pass
        run.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not ROWS:
        return
    terminalreporter.write_sep("=", "fault-injection scenarios (counted from the streams)")
    for line in format_table(ROWS).splitlines():
        terminalreporter.write_line(line)
    out = os.environ.get(ROWS_ENV)
    if out:
        Path(out).write_text(json.dumps([r.to_json() for r in ROWS], indent=1))
