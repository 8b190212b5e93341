"""A remote reward service for tests: the OpenRLHF JSON protocol with injectable faults.

    python reward_server.py --port 0 [--faults 500,drop,slow] [--always 500|drop|slow|short|none]

Prints ``listening on <port>`` once ready. reward = len(query), score = 1.0 when the label occurs
in the query else 0.0, extra_logs = {"chars": len(query)}. ``--faults`` are used up one per
request in order, then requests succeed; ``--always`` applies one fault to every request:

* ``500``: HTTP 500 with a body;  ``drop``: the connection is closed without an answer;
* ``slow``: the answer comes after ``--slow-s`` seconds;  ``short``: one reward too few.

With the environment variable ``REWARD_SERVER_TOKEN`` set, requests need ``Authorization: Bearer``
that token (else 401). ``GET /stats`` returns request and fault counts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import Counter, deque

from aiohttp import web


def build_app(faults: list[str], always: str, slow_s: float, token: str) -> web.Application:
    queue = deque(faults)
    stats: Counter[str] = Counter()

    async def score(request: web.Request) -> web.StreamResponse:
        if token and request.headers.get("Authorization") != f"Bearer {token}":
            stats["unauthorized"] += 1
            return web.json_response({"error": "unauthorized"}, status=401)
        body = await request.json()
        stats["requests"] += 1
        fault = queue.popleft() if queue else always
        stats[f"fault_{fault}"] += 1
        if fault == "500":
            return web.Response(status=500, text="injected internal error")
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

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(dict(stats))

    app = web.Application()
    app.router.add_post("/get_reward", score)
    app.router.add_get("/stats", get_stats)
    return app


async def serve(args: argparse.Namespace) -> None:
    faults = [f for f in args.faults.split(",") if f]
    app = build_app(faults, args.always, args.slow_s, os.environ.get("REWARD_SERVER_TOKEN", ""))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"listening on {port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--faults", default="", help="comma-separated faults used up in order")
    parser.add_argument("--always", default="none", choices=["none", "500", "drop", "slow", "short"])
    parser.add_argument("--slow-s", type=float, default=2.0)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
