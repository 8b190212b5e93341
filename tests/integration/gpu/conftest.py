"""The GPU kit and bench integration tests reuse the unit tier's loaders and helpers: tests/unit (e.g.
test_gpu_kit's ``deps``, test_gpu_bench's ``fake_part``) and bench/ go on the import path here."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests" / "unit"), str(ROOT / "bench")]
