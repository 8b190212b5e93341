"""AlgoConfig imports and builds without torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_config_imports_no_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import streamrl.learner.rl.algo.config as c; c.AlgoConfig()"
    paths = [str(ROOT / p) for p in ("libs/common/src", "services/learner/src")]
    env = {"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
