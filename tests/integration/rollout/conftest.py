"""The rollout integration tests: those that run a real engine (vLLM starts processes; the
transformers engine loads a model) or a rollout service on a real redis-server. Their script engines
and work items are the unit tests' (tests/unit/rollout), whose folder goes on the import path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "rollout"))
