"""A remote reward service whose behaviour a fault scenario switches while the run goes on.

Run as a process (``python scorer_server.py --port P``; prints ``listening on P`` when ready), it
speaks the OpenRLHF JSON protocol: reward = score = 1.0 when the label ends the query, else 0.0.
With ``FAULTS_SCORER_EXPECTED_TOKEN`` set, a request without ``Authorization: Bearer <that token>``
gets HTTP 401 (``unauthorized: bad bearer token``). ``POST /control {"mode": M, "slow_s": S}``
switches every later request to mode M:

* ``ok``: answer;  ``500``: HTTP 500;  ``drop``: close the connection without an answer;
* ``slow``: answer after ``slow_s`` seconds;
* ``tail``: a slow tail - every ``1 / slow_fraction``-th request (``slow_fraction``, 0.1 by default,
  set with the mode) answers after ``slow_s`` seconds, the others at once (counted as ``tail``).

``GET /stats`` counts requests by mode. :class:`ScorerServer` starts, switches, kills and restarts
it (on the same port: "down for 30 s and back").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

TOKEN_ENV = "FAULTS_SCORER_EXPECTED_TOKEN"


def _in_tail(n: int, fraction: float) -> bool:
    """Whether the ``n``-th request (from 1) is one of the slow ``fraction``: evenly spread, exactly that share."""
    return int(n * fraction) > int((n - 1) * fraction)


def build_app(token: str):  # type: ignore[no-untyped-def]
    from aiohttp import web

    state = {"mode": "ok", "slow_s": 1.0, "slow_fraction": 0.1}
    stats: Counter[str] = Counter()

    async def score(request: web.Request) -> web.StreamResponse:
        if token and request.headers.get("Authorization") != f"Bearer {token}":
            stats["unauthorized"] += 1
            return web.Response(status=401, text="unauthorized: bad bearer token")
        body = await request.json()
        mode = str(state["mode"])
        stats[mode] += 1
        if mode == "500":
            return web.Response(status=500, text="injected internal error")
        if mode == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if mode == "slow" or (mode == "tail" and _in_tail(stats[mode], float(state["slow_fraction"]))):
            stats["slowed"] += 1
            await asyncio.sleep(float(state["slow_s"]))
        queries, labels = body["query"], body["labels"]
        scores = [1.0 if label and q.endswith(label) else 0.0 for q, label in zip(queries, labels, strict=True)]
        stats["samples"] += len(queries)
        return web.json_response({"rewards": scores, "scores": scores})

    async def control(request: web.Request) -> web.Response:
        state.update(await request.json())
        return web.json_response(state)

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(dict(stats))

    app = web.Application()
    app.router.add_post("/get_reward", score)
    app.router.add_post("/control", control)
    app.router.add_get("/stats", get_stats)
    return app


async def _serve(port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(build_app(os.environ.get(TOKEN_ENV, "")), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    print(f"listening on {runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


class ScorerServer:
    """Controls one scorer server process on a fixed port."""

    def __init__(self, port: int, log: Path, token: str = "") -> None:
        self.port = port
        self.log = log
        self.token = token
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/get_reward"

    def start(self, timeout_s: float = 30.0) -> ScorerServer:
        env = {**os.environ, TOKEN_ENV: self.token}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while f"listening on {self.port}" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the scorer server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def set_mode(self, mode: str, slow_s: float = 1.0, slow_fraction: float = 0.1) -> None:
        self._call("/control", {"mode": mode, "slow_s": slow_s, "slow_fraction": slow_fraction})

    def stats(self) -> dict[str, int]:
        return self._call("/stats")  # type: ignore[no-any-return]

    def _call(self, path: str, body: dict[str, object] | None = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read())

    def kill(self) -> None:
        """SIGKILL it: connections are refused until :meth:`start` again."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(_serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
