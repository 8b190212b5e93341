"""The fresh-venv packaging tests share the package table and venv builder of the unit tier:
tests/unit/packaging/streamrl_packages.py, whose folder goes on the import path here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "packaging"))
