"""The run pauses - no prompt and no replacement issued, the cause on the progress line - while every reward worker
is paused (a scorer's token refused) or the error budget is spent, and resumes by itself (real Redis)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest
from test_coordinator import a_trajectory, coordinator

from streamrl.common.codec import encode
from streamrl.common.messages import Heartbeat

REASON = "http scorer 'remote' (http://rm:5000/get_reward): HTTP 401, not retried: the server refused the token"


def test_the_run_pauses_while_every_reward_worker_is_paused(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="streamrl.coordinator.service")
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)

    async def scenario() -> None:
        async with coordinator(recipe, run_id, redis_url) as h:

            def beat(status: str, reason: str = "") -> None:
                hb = Heartbeat(
                    service="reward", instance="r0", pid=os.getpid(), ts=time.time(), status=status, reason=reason
                )
                h.client.set(h.names.heartbeat("reward", "r0"), encode(hb), px=60_000)
                h.client.sadd(h.names.instances, "reward:r0")

            beat("paused", REASON)
            h.weights(0)
            await h.until(lambda: "paused" in h.progress(), "the pause on the progress line")
            assert h.progress()["paused"] == f"reward paused (1 of 1 workers): {REASON}"
            await asyncio.sleep(2.5)  # two full ticks and more
            assert h.prompts() == [], "a prompt went out while the reward tier was paused"
            beat("running")
            await h.until(lambda: len(h.prompts()) == 8, "the prompts, once the reward tier resumed")
            await h.until(lambda: "paused" not in h.progress(), "the pause gone from the progress line")

    asyncio.run(scenario())
    assert sum("run PAUSED" in r.getMessage() for r in caplog.records) == 1  # said once
    assert sum("run resumed" in r.getMessage() for r in caplog.records) == 1


def test_a_spent_error_budget_stops_replacing_groups_for_its_window(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="streamrl.coordinator.service")
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url)
    window = ["--coordinator.max_dead_fraction=0.5", "--coordinator.dead_window_s=4"]

    async def scenario() -> None:
        async with coordinator(recipe, run_id, redis_url, *window) as h:
            h.weights(0)
            await h.until(lambda: len(h.prompts()) >= 8, "the prompts of batches 0 and 1")
            for item in h.prompts()[:4]:  # every group of batch 0 dead-lettered (prompts_per_step = 4)
                h.dead_letter(h.names.trajectories, a_trajectory(item), error="ScorerError: rejects everything")
            await h.until(lambda: "paused" in h.progress(), "the pause on the progress line")
            paused_at = time.monotonic()
            shown = h.progress()["paused"]
            assert shown.startswith("error budget spent: 4 of the 4 groups settled in the last 4 s failed"), shown
            assert shown.endswith("last dead letter: ScorerError: rejects everything"), shown
            issued = len(h.prompts())  # 8, and replacements of the groups lost before the budget was spent
            for item in h.prompts()[4:8]:  # batch 1's groups lost while paused: none replaced meanwhile
                h.dead_letter(h.names.trajectories, a_trajectory(item), error="ScorerError: rejects everything")
            await h.until(lambda: h.counter("groups_dead") == 8, "batch 1's groups failed")
            await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - paused_at)))
            assert len(h.prompts()) == issued, "a prompt went out while the run was paused"
            await h.until(lambda: len(h.prompts()) == 16, "the replacements, once the window passed", timeout_s=15)
            await h.until(lambda: "paused" not in h.progress(), "the pause gone from the progress line")

    asyncio.run(scenario())
    # said once; the groups lost while paused did not spend the next window's budget
    assert sum("run PAUSED" in r.getMessage() for r in caplog.records) == 1
