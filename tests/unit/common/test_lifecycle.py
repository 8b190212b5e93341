"""ServiceContext.mark_running: start-up objects leave the cyclic GC, young collections get rarer."""

from __future__ import annotations

import asyncio
import gc
from unittest.mock import MagicMock

from streamrl.common.lifecycle import GC_YOUNG_THRESHOLD, ServiceConfig, ServiceContext
from streamrl.common.streams import StreamNames


def test_mark_running_freezes_start_up_objects() -> None:
    ctx = ServiceContext("svc", "i0", ServiceConfig(), MagicMock(), StreamNames("r"), asyncio.Event())
    before = gc.get_threshold()
    start_up = [{"row": i} for i in range(1000)]  # e.g. a dataset loaded at start-up
    try:
        ctx.mark_running()
        assert ctx.status == "running"
        assert ctx.snapshot()["status"] == "running"
        assert gc.get_freeze_count() >= len(start_up)
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
