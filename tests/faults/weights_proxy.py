"""A TCP proxy between the rollout workers and the learner's weight server that can hang.

The learner binds its ZMQ weight server on ``127.0.0.1:P`` (and its chunk stream on ``P + 1``) and
advertises ``127.0.0.2:P`` (``learner.weights_advertise_host``), where this proxy listens on both ports
and forwards each to its own. While
:meth:`WeightsProxy.hang` is on, new connections are accepted and held open with nothing forwarded
either way (a peer that stopped answering mid-transfer), so a worker's fetch waits until its
deadline (``rollout.weight_sync_timeout_s``). :meth:`heal` closes the held connections and forwards
again. Runs in a thread of the test process.

With ``chunk_faults`` (policy version -> ``"corrupt"`` or ``"truncate"``) the chunk port is forwarded
frame by frame (the request and reply framing of :mod:`streamrl.common.weights.chunks`): each fault
is used once, on the first chunk served (status OK, 2 bytes or more) of that version or, when the
worker skipped it, of the next version fetched - ``corrupt`` flips one byte in the middle of its
data, ``truncate`` forwards half its data and closes both connections - never twice in one version
(so each fault spoils its own fetch), and is recorded in :attr:`WeightsProxy.tampered`; every chunk
request is counted (a refetch shows there).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from streamrl.common.weights.chunks import OK, REPLY, REQUEST
from streamrl.ops.redis_server import free_port

LISTEN_HOST = "127.0.0.2"
TARGET_HOST = "127.0.0.1"
ChunkFault = Literal["corrupt", "truncate"]
Chunk = tuple[int, int, int]
"""(policy version, bucket, chunk) of a chunk request."""


@dataclass(frozen=True)
class Tampered:
    """One chunk transfer the proxy corrupted or cut short."""

    kind: ChunkFault
    version: int
    bucket: int
    chunk: int
    at: float
    requests_before: int
    """Requests for this chunk up to and including the tampered one (more later: it was fetched again)."""


def free_port_pair() -> int:
    """A port P with P + 1 free too (the weight server's chunk stream listens on the next port)."""
    for _ in range(100):
        port = free_port()
        with contextlib.suppress(OSError), socket.create_server((TARGET_HOST, port + 1)):
            return port
    raise RuntimeError("no two free ports in a row")


class WeightsProxy:
    """See the module docstring."""

    def __init__(self, port: int, chunk_faults: Mapping[int, ChunkFault] | None = None) -> None:
        self.port = port
        self.chunk_faults = dict(chunk_faults or {})
        """Policy version -> the fault its first served chunk gets (once; used ones are removed)."""
        self._framed = bool(self.chunk_faults)
        """The chunk port is forwarded frame by frame (counted), until the end."""
        self.tampered: list[Tampered] = []
        self.chunk_requests: Counter[Chunk] = Counter()
        self._spoiled: set[int] = set()
        """Versions a fault was used on."""
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
        if port == self.port + 1 and self._framed:
            asked: deque[Chunk] = deque()
            await asyncio.gather(
                self._requests(reader, up_writer, asked), self._replies(up_reader, writer, up_writer, asked)
            )
        else:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def _requests(
        self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, asked: deque[Chunk]
    ) -> None:
        """Receiver -> server: each chunk request noted (replies come back in request order), then forwarded."""
        try:
            while True:
                request = await reader.readexactly(REQUEST.size)
                _, version, bucket, chunk = REQUEST.unpack(request)
                asked.append((version, bucket, chunk))
                self.chunk_requests[(version, bucket, chunk)] += 1
                up_writer.write(request)
                await up_writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            up_writer.close()

    def _fault_for(self, version: int) -> ChunkFault | None:
        due = [v for v in self.chunk_faults if v <= version]
        if not due or version in self._spoiled:
            return None
        self._spoiled.add(version)
        return self.chunk_faults.pop(min(due))

    async def _replies(
        self,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_writer: asyncio.StreamWriter,
        asked: deque[Chunk],
    ) -> None:
        """Server -> receiver, one reply at a time: the scheduled fault applied to its chunk."""
        try:
            while True:
                header = await up_reader.readexactly(REPLY.size)
                _, status, _, length = REPLY.unpack(header)
                data = await up_reader.readexactly(length)
                asked_for = asked.popleft() if asked else (-1, -1, -1)
                kind = self._fault_for(asked_for[0]) if status == OK and length >= 2 else None
                if kind is not None:
                    self.tampered.append(Tampered(kind, *asked_for, time.time(), self.chunk_requests[asked_for]))
                if kind == "truncate":
                    writer.write(header + data[: length // 2])
                    await writer.drain()
                    return  # both connections closed below: the receiver sees its peer go mid-chunk
                if kind == "corrupt":
                    flipped = bytearray(data)
                    flipped[length // 2] ^= 0xFF
                    data = bytes(flipped)
                writer.write(header + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            writer.close()
            up_writer.close()

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
