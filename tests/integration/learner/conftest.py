"""The learner integration tests' fixtures: those of the unit tier (tests/unit/learner/learner_fixtures.py: the
tiny Qwen2 folder, the data kit), whose folder goes on the import path so that these tests also reuse the
unit tests' builders."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "learner"))

from learner_fixtures import kit, tiny_qwen_dir

__all__ = ["kit", "tiny_qwen_dir"]
