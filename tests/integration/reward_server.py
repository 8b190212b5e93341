"""A remote reward service for tests: the OpenRLHF JSON protocol with faults injected on command.

    python reward_server.py --port 0 [--faults 500,drop,slow] [--always 500|drop|slow|short|none]

Prints ``listening on <port>`` once ready. reward = len(query), score = 1.0 when the label occurs
in the query else 0.0, extra_logs = {"chars": len(query)}. ``--faults`` are used up one per
request in order, then requests succeed; ``--always`` applies one fault to every request:

* ``500``: HTTP 500 with a (multi-line) body;  ``drop``: the connection is closed without an answer;
* ``slow``: the answer comes after ``--slow-s`` seconds;  ``short``: one reward too few.

``POST /control {"always": "500", "for_s": 3}`` switches the fault applied to every request while
the server runs, for ``for_s`` seconds (then back to ``none``) or, without ``for_s``, until the
next command. To be down for a while, a test kills the process and starts it again on the same
``--port`` (:class:`ServerProcess` does both from a test). With the environment variable ``REWARD_SERVER_TOKEN`` set, requests need
``Authorization: Bearer <that token>``: a request without the header gets 401, one with another
token 403. ``GET /stats`` returns request and fault counts; ``/control`` and ``/stats`` need no token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter, deque

from aiohttp import web

FAULTS = ("none", "500", "drop", "slow", "short")


def build_app(faults: list[str], always: str, slow_s: float, token: str) -> web.Application:
    queue = deque(faults)
    stats: Counter[str] = Counter()
    mode = {"always": always, "until": float("inf")}

    def current_fault() -> str:
        if queue:
            return queue.popleft()
        if time.monotonic() >= mode["until"]:
            mode["always"], mode["until"] = "none", float("inf")
        return str(mode["always"])

    async def score(request: web.Request) -> web.StreamResponse:
        if token:
            sent = request.headers.get("Authorization")
            if sent is None:
                stats["unauthorized"] += 1
                return web.json_response({"error": "missing bearer token"}, status=401)
            if sent != f"Bearer {token}":
                stats["forbidden"] += 1
                return web.json_response({"error": "invalid token"}, status=403)
        body = await request.json()
        stats["requests"] += 1
        fault = current_fault()
        stats[f"fault_{fault}"] += 1
        if fault == "500":
            return web.Response(status=500, text="injected internal error\nTraceback (most recent call last): ...")
        if fault == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if fault == "slow":
            await asyncio.sleep(slow_s)
        queries, labels = body["query"], body["labels"]
        rewards = [float(len(q)) for q in queries]
        if fault == "short":
            rewards = rewards[:-1]
        stats["samples"] += len(queries)
        return web.json_response(
            {
                "rewards": rewards,
                "scores": [1.0 if label and label in q else 0.0 for q, label in zip(queries, labels, strict=True)],
                "extra_logs": {"chars": [len(q) for q in queries]},
            }
        )

    async def control(request: web.Request) -> web.Response:
        command = await request.json()
        if command.get("always") not in FAULTS:
            return web.json_response({"error": f"always must be one of {FAULTS}"}, status=400)
        for_s = command.get("for_s")
        mode["always"] = command["always"]
        mode["until"] = float("inf") if for_s is None else time.monotonic() + float(for_s)
        return web.json_response({"ok": True})

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(dict(stats))

    app = web.Application()
    app.router.add_post("/get_reward", score)
    app.router.add_post("/control", control)
    app.router.add_get("/stats", get_stats)
    return app


async def serve(args: argparse.Namespace) -> None:
    faults = [f for f in args.faults.split(",") if f]
    app = build_app(faults, args.always, args.slow_s, os.environ.get("REWARD_SERVER_TOKEN", ""))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]
    print(f"listening on {port}", flush=True)
    await asyncio.Event().wait()


class ServerProcess:
    """This server run as a subprocess by a test: start, kill (down), start again on the same port,
    switch faults, read stats.

    Example:
        server = ServerProcess("--always", "500", token="t0ken")
        url = server.start()          # http://127.0.0.1:PORT/get_reward
        server.kill(); server.start() # down, then back on the same port
    """

    def __init__(self, *args: str, token: str = "") -> None:
        self.args = list(args)
        self.token = token
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/get_reward"

    def start(self) -> str:
        assert self.proc is None, "already running"
        env = {**os.environ, "REWARD_SERVER_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, __file__, "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("listening on "), f"reward server did not start: {line!r}"
        self.port = int(line.split()[-1])
        return self.url

    def kill(self) -> None:
        """SIGKILL: connections reset, the port refuses connections until :meth:`start`."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.proc = None

    def control(self, always: str, for_s: float | None = None) -> None:
        """Apply fault ``always`` to every request (for ``for_s`` seconds, else until the next call)."""
        self._call("/control", {"always": always, "for_s": for_s})

    def stats(self) -> dict[str, int]:
        return self._call("/stats")  # type: ignore[no-any-return]

    def _call(self, path: str, body: dict[str, object] | None = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url.replace("/get_reward", path), data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.loads(resp.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--faults", default="", help="comma-separated faults used up in order")
    parser.add_argument("--always", default="none", choices=FAULTS)
    parser.add_argument("--slow-s", type=float, default=2.0)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
