"""Tasks stop for sure even when a cancellation is swallowed (Python 3.11 ``asyncio.wait_for``); the services'
event loop is the one STREAMRL_EVENT_LOOP names."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.common.aio import EVENT_LOOP_ENV, cancel_and_wait, event_loop, run, wait_set


async def _swallows_first_cancel(log: list[str]) -> None:
    """Behaves like a loop whose awaited call dropped the cancellation: it carries on once."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if swallowed:
                log.append("ended")
                raise
            swallowed = True
            log.append("swallowed")


def test_cancel_and_wait_cancels_again_a_task_that_carried_on() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        task = asyncio.create_task(_swallows_first_cancel(log))
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait([task], recancel_s=0.01), timeout=5)
        assert task.cancelled()
        return log

    assert asyncio.run(main()) == ["swallowed", "ended"]


def test_plain_cancel_leaves_such_a_task_running() -> None:
    """The failure cancel_and_wait exists for: one cancel() and the task is still alive."""

    async def main() -> bool:
        task = asyncio.create_task(_swallows_first_cancel([]))
        await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.1)
        alive = not done
        await cancel_and_wait([task])
        return alive

    assert asyncio.run(main())


def test_wait_set() -> None:
    async def main() -> tuple[bool, bool]:
        event = asyncio.Event()
        missed = await wait_set(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        return missed, await wait_set(event, 5)

    assert asyncio.run(main()) == (False, True)


def test_wait_set_passes_an_outside_cancellation_through() -> None:
    async def main() -> bool:
        task = asyncio.create_task(wait_set(asyncio.Event(), 60))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        return task.cancelled()

    assert asyncio.run(main())


@pytest.mark.parametrize("choice", ["uvloop", "asyncio"])
def test_run_runs_on_the_loop_the_environment_names(choice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, choice)

    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(main()).startswith("uvloop" if choice == "uvloop" else "asyncio")


def test_uvloop_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert event_loop() == "uvloop"


def test_an_unknown_event_loop_is_refused_naming_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match=r"STREAMRL_EVENT_LOOP='trio' .*uvloop or asyncio"):
        event_loop()
