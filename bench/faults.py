"""Fault-injection table: run tests/faults and keep its rows.

Runs ``pytest -q tests/faults`` (every scenario: real redis-server, the four services as processes,
one fault each; see tests/faults/harness.py), collects the row of each scenario (issued, trained,
dropped by reason, lost, trained twice, pending at the end, steps reached, recovery) and writes
them to ``bench/results/faults-<date>.json`` with the date, the machine and the command.

The lost-reply rows (tests/faults/test_lost_replies.py) run every service through a fault proxy; the
JSON's ``write_points`` lists, per service, every kind of write seen through it and how many times
its reply was lost in the rows (0: a write point no row covered).

Usage: python bench/faults.py [-k EXPR] [--each-kind]. pytest's output (with the table) goes to stdout; the last
line is one JSON object: the file written, pass/fail counts and wall time. Each scenario's folder
(service logs, the redis AOF) is kept under the ``logs`` folder named in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ROWS_ENV = "STREAMRL_FAULTS_ROWS"
"""Where tests/faults/conftest.py writes the rows as JSON."""


def write_points(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Service -> kind of write -> replies of it lost over all rows (from the rows' proxy details)."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        for service, kinds in row.get("details", {}).get("writes_seen", {}).items():
            for kind in kinds:
                out.setdefault(service, {}).setdefault(kind, 0)
    for row in rows:
        for key, n in row.get("details", {}).get("lost_replies", {}).items():
            service, kind = key.split(": ", 1)
            out.setdefault(service, {})[kind] = out.get(service, {}).get(kind, 0) + n
    return {s: dict(sorted(k.items())) for s, k in sorted(out.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", default="", help="only the scenarios matching this pytest -k expression")
    parser.add_argument(
        "--each-kind",
        action="store_true",
        help="also one lost-reply row per write point of tests/faults/write_points.json (~80 runs)",
    )
    args = parser.parse_args()
    now = datetime.now(timezone.utc)
    logs = Path(tempfile.gettempdir()) / f"streamrl-faults-{now:%Y%m%d-%H%M%S}"
    cmd = [sys.executable, "-m", "pytest", "-q", f"--basetemp={logs}", "tests/faults"]
    cmd += ["-k", args.k] if args.k else []
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.json"
        started = time.monotonic()
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env={**os.environ, ROWS_ENV: str(rows_path), **({"FAULTS_EACH_KIND": "1"} if args.each_kind else {})},
            check=False,
        )
        wall_s = round(time.monotonic() - started, 1)
        rows = json.loads(rows_path.read_text()) if rows_path.exists() else []
    result = {
        "bench": "faults",
        "date": now.isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "command": " ".join(["python", "bench/faults.py", *sys.argv[1:]]) + f"  (runs: {' '.join(cmd[1:])})",
        "pytest_exit_code": done.returncode,
        "wall_s": wall_s,
        "logs": str(logs),
        "passed": sum(1 for r in rows if not r["failures"]),
        "failed": sum(1 for r in rows if r["failures"]),
        "write_points": write_points(rows),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"faults-{now:%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k] for k in ("bench", "date", "pytest_exit_code", "wall_s", "passed", "failed")}
    print(json.dumps({**summary, "file": str(out.relative_to(ROOT))}))


if __name__ == "__main__":
    main()
