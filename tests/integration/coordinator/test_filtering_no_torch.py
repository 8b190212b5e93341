"""The coordinator's filtering module imports without torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_imports_no_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import streamrl.coordinator.filtering"
    env = {"PYTHONPATH": str(ROOT / "services/coordinator/src"), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
