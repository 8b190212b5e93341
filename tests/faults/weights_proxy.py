"""A TCP proxy between the rollout workers and the learner's weight server that can hang.

The learner binds its ZMQ weight server on ``127.0.0.1:P`` (and its chunk stream on ``P + 1``) and
advertises ``127.0.0.2:P`` (``learner.weights_advertise_host``), where this proxy listens on both ports
and forwards each to its own. While
:meth:`WeightsProxy.hang` is on, new connections are accepted and held open with nothing forwarded
either way (a peer that stopped answering mid-transfer), so a worker's fetch waits until its
deadline (``rollout.weight_sync_timeout_s``). :meth:`heal` closes the held connections and forwards
again. Runs in a thread of the test process.
"""

from __future__ import annotations

import asyncio
import functools
import threading

LISTEN_HOST = "127.0.0.2"
TARGET_HOST = "127.0.0.1"


class WeightsProxy:
    """See the module docstring."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.hanging = False
        self.held = 0
        """Connections held without forwarding (the fault reached a fetch)."""
        self.forwarded = 0
        self._held: list[asyncio.StreamWriter] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._servers: list[asyncio.Server] = []
        self._thread = threading.Thread(target=self._run, name="weights-proxy", daemon=True)

    def start(self) -> WeightsProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        for port in (self.port, self.port + 1):  # the ZMQ weight server and its chunk stream
            client = functools.partial(self._on_client, port=port)
            self._servers.append(self._loop.run_until_complete(asyncio.start_server(client, LISTEN_HOST, port)))
        self._ready.set()
        self._loop.run_forever()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        if self.hanging:
            self.held += 1
            self._held.append(writer)
            return
        self.forwarded += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(TARGET_HOST, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    def hang(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "hanging", True)

    def heal(self) -> None:
        def _heal() -> None:
            self.hanging = False
            for writer in self._held:
                writer.close()
            self._held.clear()

        self._loop.call_soon_threadsafe(_heal)

    def close(self) -> None:
        def _stop() -> None:
            for server in self._servers:
                server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(_stop)
        self._thread.join(10)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
