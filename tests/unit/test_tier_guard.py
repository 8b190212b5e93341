"""The unit tier's guard (tests/unit/conftest.py) fails a unit test that uses Redis or starts a process.

Planted tests run under the real conftest text in a pytester folder (in this process): each way of
reaching Redis or starting a process must fail its test with the guard's message, even when the code
under test swallows the error; plain tests (threads, a loopback socket) must still pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

GUARD = Path(__file__).with_name("conftest.py")

PLANTED = """
import asyncio
import multiprocessing
import os
import socket
import subprocess
import sys
import threading

import redis
import redis.asyncio


def test_subprocess_run():
    subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_swallowed_subprocess():
    try:
        subprocess.Popen(["true"])
    except Exception:
        pass


def test_os_system():
    os.system("true")


def test_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)


def test_multiprocessing_spawn():
    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()


def test_asyncio_subprocess():
    async def main():
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()

    asyncio.run(main())


def test_sync_redis_client():
    redis.Redis(host="127.0.0.1", port=6399, socket_connect_timeout=0.2).ping()


def test_async_redis_client():
    async def main():
        client = redis.asyncio.Redis(host="127.0.0.1", port=6399, socket_connect_timeout=0.2)
        try:
            await client.ping()
        finally:
            await client.aclose()

    asyncio.run(main())


def test_redis_url_fixture(redis_url):
    pass


def test_redis_cluster_url_fixture(redis_cluster_url):
    pass


def test_allowed_thread_and_loopback_socket():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()[0]))
    thread.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        thread.join(5)
    accepted[0].close()
    server.close()
    assert accepted
"""

BLOCKED = {
    "test_subprocess_run": "starts a process",
    "test_swallowed_subprocess": "starts a process",
    "test_os_system": "starts a process",
    "test_fork": "starts a process",
    "test_multiprocessing_spawn": "starts a process",
    "test_asyncio_subprocess": "starts a process",
    "test_sync_redis_client": "opens a Redis connection",
    "test_async_redis_client": "opens a Redis connection",
    "test_redis_url_fixture": "uses the redis_url fixture",
    "test_redis_cluster_url_fixture": "uses the redis_cluster_url fixture",
}


def test_the_guard_fails_each_planted_redis_or_process_use_and_passes_the_rest(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(GUARD.read_text())
    pytester.makepyfile(test_planted=PLANTED)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rf")
    outcomes = {}
    for report in result.reprec.getreports("pytest_runtest_logreport"):  # type: ignore[attr-defined]
        name = report.nodeid.split("::")[-1]
        if report.failed or name not in outcomes:
            outcomes[name] = (report.outcome, str(report.longrepr or ""))
    assert outcomes["test_allowed_thread_and_loopback_socket"][0] == "passed"
    for name, what in BLOCKED.items():
        outcome, text = outcomes[name]
        assert outcome == "failed", f"{name} was not stopped by the guard"
        assert what in text and "tests/integration" in text, f"{name}: {text[-600:]}"
