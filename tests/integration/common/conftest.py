"""Fixtures of the shared library's integration tests: helpers shared with the unit tier are imported from
tests/unit/common (put on the import path here), e.g. ``prom_scrape``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "common"))
