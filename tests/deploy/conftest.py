"""The deploy tests (run by ``make test-integration``) reuse the unit tier's Dockerfile parser
(tests/unit/test_dockerfiles.py): tests/unit goes on the import path here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
