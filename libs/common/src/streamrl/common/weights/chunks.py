"""Raw TCP chunk server of the weight wire: the data half of the streaming path (no ZMQ, no torch).

A :class:`~streamrl.common.weights.wire.BucketServer` runs one next to its ZMQ socket. A streaming
receiver (:mod:`streamrl.common.weights.stream`) opens several connections and, on each, asks for
chunks of the version's buckets with a few requests in flight::

    request  REQUEST  {magic "SRWq", version i64, bucket i32, chunk i32}            20 bytes
    reply    REPLY    {magic "SRWr", status i32, current_version i64, length i64}   28 bytes
             then ``length`` bytes: the chunk's data (status OK) or a UTF-8 error message

A chunk is ``chunk_bytes`` of a bucket's data (the last one shorter), sent straight from the
published buffer (``sendall`` of a memoryview: no copy in Python). Requests for a version other
than the one served get ``REFUSED`` and a message naming the current version, as on the ZMQ path.
Nothing here is trusted by the receiver: it checks every chunk against the manifest's digest.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrl.common.weights.wire import EncodedVersion

logger = logging.getLogger(__name__)

REQUEST = struct.Struct("<4sqii")
REPLY = struct.Struct("<4siqq")
REQUEST_MAGIC = b"SRWq"
REPLY_MAGIC = b"SRWr"
OK = 0
REFUSED = 1


def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False when the peer closed before it was full."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def chunk_reply(request: bytes, current: EncodedVersion | None) -> tuple[int, int, memoryview | bytes]:
    """(status, current version, payload) answering one request (pure: the server only moves bytes)."""
    current_version = -1 if current is None else current.version
    magic, version, bucket, chunk = REQUEST.unpack(request)
    if magic != REQUEST_MAGIC:
        return REFUSED, current_version, b"not a weight chunk request"
    if current is None or version != current.version:
        return (
            REFUSED,
            current_version,
            f"version {version} is not served (current version: {current_version})".encode(),
        )
    if not 0 <= bucket < len(current.buckets) or not 0 <= chunk < len(current.digests[bucket]):
        return REFUSED, current_version, f"chunk {bucket}/{chunk} out of range (version {version})".encode()
    start = chunk * current.chunk_bytes
    return OK, current_version, memoryview(current.buckets[bucket].data)[start : start + current.chunk_bytes]


class ChunkServer:
    """Serves chunks of ``get_current()`` on a raw TCP port of ``host`` (``port`` 0: a free one), one
    thread per connection."""

    POLL_S = 0.1

    def __init__(self, host: str, get_current: Callable[[], EncodedVersion | None], port: int = 0) -> None:
        self._get_current = get_current
        self._listener = socket.create_server((host if host != "*" else "", port), backlog=64)
        self._listener.settimeout(self.POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="weights-chunks", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="weights-chunk-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        request = bytearray(REQUEST.size)
        try:
            while recv_exactly(conn, memoryview(request)):
                status, current_version, payload = chunk_reply(bytes(request), self._get_current())
                conn.sendall(REPLY.pack(REPLY_MAGIC, status, current_version, len(payload)))
                conn.sendall(payload)
        except OSError as e:  # the receiver went away mid-reply, or close()
            logger.debug("weight chunk connection ended: %s", e)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting and end every connection."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        self._thread.join()
        self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
