"""Fixtures of the shared library's integration tests: helpers shared with the unit tier are imported from
tests/unit/common (put on the import path here), e.g. ``prom_scrape``; ``root_logging`` for tests that run ``service_main``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "common"))


@pytest.fixture
def root_logging() -> Iterator[None]:
    """``service_main`` configures the root logger; put it back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
