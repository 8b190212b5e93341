"""The unit tier's guard: a test under tests/unit fails if it opens a Redis connection or starts a process.

Unit tests are the quick loop run on every edit (``make test-unit``, under 2 minutes on 2 cores): one
process, no server. A test that needs a real redis-server or a child process (a worker script, a venv,
``sys.executable -c``, DeepSpeed or torch.distributed launches) belongs in ``tests/integration/<area>/``
under the same name. Around each phase of a unit test (setup, call, teardown) the guard replaces:

* the connect of redis-py's connections (sync and asyncio, so every client, pool and cluster), and the
  ``redis_url`` / ``redis_cluster_url`` fixtures;
* process creation: ``subprocess.Popen`` (hence ``subprocess.run``, ``os.popen`` and asyncio's
  subprocesses), ``multiprocessing``'s spawn and forkserver launcher, ``os.fork`` / ``os.forkpty``
  (the fork start method, ``os.spawn*``, ``pty``), ``os.posix_spawn(p)`` and ``os.system``.

Each replacement raises :class:`TierViolationError` naming what was attempted, and the test fails even if
the code under test swallowed that error. Threads and loopback sockets (an HTTP server under test)
stay allowed. tests/unit/test_tier_guard.py plants each case and checks that it is caught.

Warnings are errors everywhere (pytest.ini); here also an unclosed socket, file or client (ResourceWarning,
and the unraisable-exception warning that carries it from a destructor) found while a unit test runs, which
pytest.ini still lets pass in the other tiers (make test-unit ran clean with both as errors session-wide).
"""

from __future__ import annotations

import multiprocessing.util
import os
import platform
import subprocess
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio.connection
import redis.connection

# platform.platform() (the openai client calls it for its headers) runs `uname -p` once per process and
# caches it: run it here, outside any test, so that no unit test is charged with starting that process.
platform.processor()

MOVE_HINT = "unit tests run without Redis and without child processes: move this test to tests/integration/<area>/"


class TierViolationError(RuntimeError):
    """A unit test reached Redis or started a process."""


def _blocker(seen: list[str], what: str) -> Callable[..., Any]:
    """A stand-in that records ``what`` and raises :class:`TierViolationError`."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        shown = _describe(args)
        detail = f"{what} ({shown})" if shown else what
        seen.append(detail)
        raise TierViolationError(f"this unit test {detail}; {MOVE_HINT}")

    return refuse


def _async_blocker(seen: list[str], what: str) -> Callable[..., Any]:
    refuse = _blocker(seen, what)

    async def refuse_async(*args: Any, **kwargs: Any) -> Any:
        return refuse(*args, **kwargs)

    return refuse_async


def _describe(args: tuple[Any, ...]) -> str:
    """The blocked call's command or connection, for the message (other arguments are left out)."""
    parts = []
    for arg in args:
        if isinstance(arg, redis.connection.AbstractConnection | redis.asyncio.connection.AbstractConnection):
            parts.append(" ".join(f"{key}={value}" for key, value in arg.repr_pieces()))
        elif isinstance(arg, str | bytes | list | tuple | os.PathLike) and arg:
            parts.append(repr(arg))
    return "; ".join(parts)[:300]


@contextmanager
def guarded(seen: list[str]) -> Iterator[None]:
    """Replace every way of reaching Redis or starting a process, recording attempts in ``seen``."""
    process = "starts a process"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _blocker(seen, f"{process}: subprocess.Popen"))
        patch.setattr(multiprocessing.util, "spawnv_passfds", _blocker(seen, f"{process}: multiprocessing"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                patch.setattr(os, name, _blocker(seen, f"{process}: os.{name}"))
        redis_use = "opens a Redis connection"
        patch.setattr(redis.connection.AbstractConnection, "connect", _blocker(seen, redis_use))
        patch.setattr(redis.asyncio.connection.AbstractConnection, "connect", _async_blocker(seen, redis_use))
        yield


def _phase() -> Generator[None, Any, Any]:
    """One guarded phase of a test: failed if it reached Redis or a process, swallowed or not."""
    seen: list[str] = []
    with guarded(seen):
        result = yield
    if seen:
        raise TierViolationError(f"this unit test {seen[0]} (the error was swallowed); {MOVE_HINT}")
    return result


STRICT_HERE = ("error::ResourceWarning", "error::pytest.PytestUnraisableExceptionWarning")


UNIT_TIER = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(UNIT_TIER):  # the hook sees the whole session's items
            for rule in STRICT_HERE:
                item.add_marker(pytest.mark.filterwarnings(rule))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.fixture(scope="session")
def redis_url() -> str:
    raise TierViolationError(f"this unit test uses the redis_url fixture; {MOVE_HINT}")


@pytest.fixture(scope="session")
def redis_cluster_url() -> str:
    raise TierViolationError(f"this unit test uses the redis_cluster_url fixture; {MOVE_HINT}")
