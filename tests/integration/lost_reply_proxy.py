"""A TCP proxy between a Redis client and a real redis-server that loses one reply on demand.

``proxy.drop_reply_to(marker)`` arms it: the next command whose bytes hold ``marker`` (for example
``b"EXEC\\r\\n"``, or a script's SHA) is forwarded to Redis, Redis runs it, and the proxy then closes
the client's connection instead of forwarding the reply. The client sees a connection error for a
command that did run - the ambiguous fault a real network produces - and its outage retry sends
the command again; that re-send (the same bytes) is never lost in its turn. Everything else is
forwarded unchanged. 127.0.0.1 only; one proxy per test.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LostReplyProxy:
    """See the module docstring. ``dropped`` counts the replies lost so far, ``forwarded`` the replies
    (chunks of them) passed on."""

    upstream_host: str
    upstream_port: int
    port: int = 0
    dropped: int = 0
    forwarded: int = 0
    _marker: bytes | None = None
    _last_lost: bytes = b""
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _handlers: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    async def start(self) -> LostReplyProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._handlers, return_exceptions=True)

    def drop_reply_to(self, marker: bytes) -> None:
        """Lose the reply of the next command holding ``marker`` (once)."""
        self._marker = marker

    @property
    def armed(self) -> bool:
        return self._marker is not None

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        up_r, up_w = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        swallow = asyncio.Event()

        async def to_server() -> None:
            tail = b""
            while data := await client_r.read(1 << 16):
                seen = tail + data
                tail = seen[-64:]
                if self._marker is not None and self._marker in seen and data != self._last_lost:
                    self._marker, self._last_lost = None, data  # (its re-send, the same bytes, goes through)
                    swallow.set()  # before Redis can answer: its reply is never forwarded
                up_w.write(data)
                await up_w.drain()

        async def to_client() -> None:
            while data := await up_r.read(1 << 16):
                if swallow.is_set():
                    # Redis answered, so it ran the command: the client loses the connection instead
                    self.dropped += 1
                    client_w.close()
                    await asyncio.sleep(0.2)  # let Redis finish whatever the chunk held
                    return
                client_w.write(data)
                self.forwarded += 1
                await client_w.drain()

        pumps = [asyncio.create_task(to_server()), asyncio.create_task(to_client())]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            for writer in (client_w, up_w):
                with contextlib.suppress(Exception):
                    writer.close()
