"""Streaming receiver of the weight wire: pipelined chunks over several TCP connections (no torch).

:meth:`StreamReceiver.fetch` receives one version from a :class:`~streamrl.common.weights.wire.BucketServer`:

1. the :class:`~streamrl.common.weights.wire.Manifest` over the server's ZMQ socket (the endpoint of
   the ``WeightsPublished`` event), checked against the event's checksum before any data moves: the
   checksum binds every bucket header and every chunk digest, so from here on each chunk can be
   verified alone;
2. the chunks, over ``num_connections`` raw TCP connections to the server's chunk port
   (:mod:`streamrl.common.weights.chunks`), each keeping ``requests_in_flight`` requests queued; the
   connections take chunks in bucket order from one shared list, so a large bucket is spread over all
   of them. Each chunk lands with ``recv_into`` at its place in one preallocated staging buffer (kept
   and reused across versions: no allocation or page fault per version), and the connection's thread
   hashes (blake3) each piece a ``recv_into`` returns while it is still in the cache;
3. a bucket is yielded, as a :class:`VerifiedBucket` of read-only arrays over the staging buffer, as
   soon as every chunk of it verified - while later chunks are still in flight. The caller copies its
   tensors into the engine (the one copy) before it asks for the next one.

A chunk that fails its digest (corrupted in transit) or is cut short by a dropped connection is fetched
again alone, on a new connection, up to :data:`CHUNK_TRIES` times in all (one WARNING line each): one
flipped byte costs a chunk, not the version.

The contract for the caller: **a version is applied only when the iteration ends without an
error.** A chunk that failed :data:`CHUNK_TRIES` times, a server that goes away (a lost chunk's new
connection refused), a refused version (the server moved
on), a missed deadline or an abandon raise :class:`~streamrl.common.errors.WeightSyncError`, and no
bucket that did not verify is ever yielded - but the buckets yielded before the error may already be
in the engine. An engine that applied buckets in place must then not serve that half-applied
version: it fetches again (the same version, or the newer one the error names) and serves only once
one whole version went through, or falls back to :func:`~streamrl.common.weights.wire.fetch_buckets`,
which verifies everything before it yields a single tensor.

The buffers a yielded bucket's arrays view stay valid until the next :meth:`StreamReceiver.fetch`.

Delta sync (issue 39 item 3): once a fetch went through whole, the receiver remembers that its staging
buffer holds the verified bytes of that version (and its checksum). The next fetch, after the manifest,
asks the server for the delta from it (:func:`~streamrl.common.weights.wire.fetch_delta`): the chain of
single-step links to the new version when the server still keeps them (at most ``max_behind`` versions
back, and smaller than a quarter of the full bytes), applies them in place in the staging buffer, then
recomputes **every** chunk digest of the new version and compares it with the (checksummed) manifest -
the same check a full fetch makes, so nothing depends on the encoding or the server's honesty. Only then
are the buckets yielded, all of them. A receiver that holds nothing (new, released, or its last fetch
failed or was cut short), whose layout differs, whose server sends no delta, or whose delta fails to
apply or to verify fetches the full version as above (logging one line why). :attr:`StreamReceiver.last`
says what the last fetch moved.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

import blake3
import msgspec
import numpy as np
import zmq

from streamrl.common.errors import WeightSyncError
from streamrl.common.weights.chunks import OK, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC, recv_exactly
from streamrl.common.weights.delta import apply_version_delta
from streamrl.common.weights.wire import (
    ABANDON_POLL_S,
    ALIGN_BYTES,
    CONNECT_TIMEOUT_S,
    BucketHeader,
    Manifest,
    ReceivedTensor,
    chunk_digests,
    decode_bucket,
    fetch_delta,
    fetch_manifest,
    layout_of,
)

logger = logging.getLogger(__name__)

DEFAULT_CONNECTIONS = 4
"""TCP connections a receiver opens to the chunk server (bench/weights_plane.py, 2026-12-07, 2 cores at load 1: 4 gave 3.01 / 3.10 GB/s for the 0.5B / 1.5B sets against 2.89 / 2.96 with 2; under load 4 won three of four rows)."""
REQUESTS_IN_FLIGHT = 2
"""Chunk requests each connection keeps queued at the server (hides the request round trip)."""
CHUNK_TRIES = 3
"""Fetches of one chunk within one version: a chunk that fails its digest (corrupted in transit) or is cut
short by a dropped connection is fetched again on a new connection, alone, up to this many times in all;
then the version fails. A 15 GB version is not fetched again for one flipped byte."""


class _ChunkLostError(Exception):
    """A connection lost the chunk it was receiving (``chunk``; its digest failed, or it was cut short):
    that chunk and ``pending`` (requested on the same connection, not received) go back to the queue."""

    def __init__(self, chunk: _Chunk, pending: list[_Chunk], reason: str) -> None:
        super().__init__(reason)
        self.chunk, self.pending, self.reason = chunk, pending, reason


class VerifiedBucket(NamedTuple):
    """One bucket whose every chunk matched the manifest: its tensors, views of the staging buffer."""

    bucket: int
    """Its index in the version."""
    num_buckets: int
    tensors: list[ReceivedTensor]


class SyncInfo(NamedTuple):
    """What one fetch moved: ``kind`` ``delta`` (``base_version`` -> ``version``) or ``full``."""

    version: int
    kind: str
    num_bytes: int
    """Bytes received: the delta links, or the version's data (the manifest not counted)."""
    full_bytes: int
    """The version's data bytes (what a full fetch moves)."""
    base_version: int = -1
    reason: str = ""
    """Why a full fetch (empty for a delta)."""


class _Held(NamedTuple):
    """The version whose verified bytes the staging buffer holds."""

    version: int
    checksum: str
    manifest: Manifest


class _Chunk(NamedTuple):
    bucket: int
    chunk: int
    start: int
    """Offset in the staging buffer."""
    length: int


class StreamReceiver:
    """Receives versions with several pipelined connections into one staging buffer it keeps.

    Example:
        receiver = StreamReceiver()
        for bucket in receiver.fetch(event.endpoint, event.version, event.checksum, timeout_s=60):
            for t in bucket.tensors:
                params[t.name].copy_(as_tensor(t))  # the one copy into the engine
        # reaching here: every bucket verified, the version is whole
    """

    def __init__(
        self,
        num_connections: int = DEFAULT_CONNECTIONS,
        requests_in_flight: int = REQUESTS_IN_FLIGHT,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        allocate: Callable[[int], memoryview] | None = None,
    ) -> None:
        """``allocate(num_bytes)``: a writable buffer of at least that many bytes for the staging (e.g.
        a pinned torch tensor's memory, for the copy to a GPU); default: host memory, pages touched."""
        if num_connections < 1 or requests_in_flight < 1:
            raise ValueError("num_connections and requests_in_flight must be >= 1")
        self.num_connections = num_connections
        self.requests_in_flight = requests_in_flight
        self._context = context
        self._allocate = allocate or _host_buffer
        self._staging = memoryview(b"")
        self._held: _Held | None = None
        self.last: SyncInfo | None = None
        """What the last fetch that went through whole moved."""

    def staging(self, num_bytes: int) -> memoryview:
        """The staging buffer, grown (only when too small) to hold ``num_bytes``."""
        if len(self._staging) < num_bytes:
            self._held = None
            self._staging = memoryview(b"")  # (drop the old one first)
            self._staging = memoryview(self._allocate(num_bytes)).cast("B")
            if self._staging.readonly or len(self._staging) < num_bytes:
                raise ValueError(f"allocate({num_bytes}) gave a read-only or smaller buffer")
        return self._staging[:num_bytes]

    def fetch(
        self,
        endpoint: str,
        version: int,
        checksum: str | None,
        timeout_s: float,
        abandoned: threading.Event | None = None,
    ) -> Iterator[VerifiedBucket]:
        """Yield every bucket of ``version`` from the server at ``endpoint`` as it verifies (module
        docstring: the caller's contract); ``checksum`` None: the manifest is not checked (each chunk
        still is, against it). Errors within ``timeout_s`` (a dead server within ``CONNECT_TIMEOUT_S``)."""
        deadline = time.monotonic() + timeout_s
        manifest = fetch_manifest(endpoint, version, checksum, deadline, self._context, abandoned)
        headers, chunks = _plan(manifest, endpoint)
        full_bytes = sum(manifest.bucket_bytes)
        held, self._held = self._held, None  # the staging buffer is in flux until this fetch ends whole
        reason = self._try_delta(endpoint, manifest, headers, held, checksum, deadline, abandoned)
        if isinstance(reason, int):
            staging = self.staging(sum(_aligned(n) for n in manifest.bucket_bytes))
            for index, start in enumerate(_starts(manifest.bucket_bytes)):
                data = staging[start : start + manifest.bucket_bytes[index]]
                yield VerifiedBucket(index, len(headers), decode_bucket(headers[index], data))
            assert held is not None
            self._finish(manifest, checksum, SyncInfo(version, "delta", reason, full_bytes, held.version))
            return
        staging = self.staging(sum(_aligned(n) for n in manifest.bucket_bytes))
        transfer = _Transfer(self, endpoint, manifest, chunks, staging, deadline, abandoned)
        try:
            transfer.start()
            for index in transfer.verified_buckets():
                start = transfer.bucket_starts[index]
                data = staging[start : start + manifest.bucket_bytes[index]]
                yield VerifiedBucket(index, len(headers), decode_bucket(headers[index], data))
        finally:
            transfer.stop()
        self._finish(manifest, checksum, SyncInfo(version, "full", full_bytes, full_bytes, reason=reason))

    def release(self) -> None:
        """Drop the staging buffer (and with it the held version: the next fetch is a full one)."""
        self._held = None
        self._staging = memoryview(b"")

    def _finish(self, manifest: Manifest, checksum: str | None, info: SyncInfo) -> None:
        """The fetch went through whole: the staging buffer holds ``manifest``'s version, verified."""
        self.last = info
        if checksum is not None:  # (a delta is asked for by checksum: nothing to ask with without one)
            self._held = _Held(manifest.version, checksum, manifest)

    def _try_delta(
        self,
        endpoint: str,
        manifest: Manifest,
        headers: list[BucketHeader],
        held: _Held | None,
        checksum: str | None,
        deadline: float,
        abandoned: threading.Event | None,
    ) -> int | str:
        """Bring the staging buffer from ``held`` to ``manifest``'s version with deltas and verify every
        chunk: the delta bytes received, or why not (then the staging buffer is to be fetched whole)."""
        if held is None:
            return "no verified version held"
        if held.version >= manifest.version:
            return f"held version {held.version} is not behind {manifest.version}"
        if checksum is None:
            return "no checksum to verify a delta against"
        layout = layout_of(manifest.headers, manifest.bucket_bytes)
        if layout != layout_of(held.manifest.headers, held.manifest.bucket_bytes):
            return "the tensor layout changed"
        try:
            links = fetch_delta(
                endpoint, manifest.version, held.version, held.checksum, deadline, self._context, abandoned
            )
        except WeightSyncError as e:
            return f"delta request failed: {e}"
        if isinstance(links, str):
            return f"server sent none: {links}"
        staging = self.staging(sum(_aligned(n) for n in manifest.bucket_bytes))
        sizes = manifest.bucket_bytes
        buckets = [staging[start : start + size] for start, size in zip(_starts(sizes), sizes, strict=True)]
        failure = _apply_links(buckets, links, held.version, manifest, headers, endpoint)
        return failure if failure is not None else sum(len(link) for link in links)


def _apply_links(
    buckets: list[memoryview],
    links: list[memoryview],
    held_version: int,
    manifest: Manifest,
    headers: list[BucketHeader],
    endpoint: str,
) -> str | None:
    """Apply ``links`` to the staging ``buckets`` (holding ``held_version``) in place, then check every chunk
    digest of ``manifest``; None when the buckets now hold its version, else why not (logged)."""
    what = f"delta {held_version}->{manifest.version} from {endpoint}"
    at = held_version
    try:
        for link in links:
            base, at_next = apply_version_delta(buckets, link)
            if base != at:
                raise ValueError(f"a link starts at version {base}, not {at}")
            at = at_next
        if at != manifest.version:
            raise ValueError(f"the links end at version {at}")
    except ValueError as e:
        logger.warning("%s failed to apply (%s): fetching the full version", what, e)
        return f"delta failed to apply: {e}"
    for index, bucket in enumerate(buckets):  # every chunk, as a full fetch checks them
        if chunk_digests(bucket, headers[index].chunk_bytes) != manifest.digests[index]:
            logger.warning("%s failed the checksum of bucket %d: fetching the full version", what, index)
            return f"delta failed the checksum of bucket {index}"
    return None


def stream_buckets(
    endpoint: str,
    version: int,
    checksum: str | None,
    timeout_s: float,
    abandoned: threading.Event | None = None,
    num_connections: int = DEFAULT_CONNECTIONS,
) -> Iterator[VerifiedBucket]:
    """One :meth:`StreamReceiver.fetch` with a fresh receiver (its staging buffer is not kept)."""
    yield from StreamReceiver(num_connections).fetch(endpoint, version, checksum, timeout_s, abandoned)


def _host_buffer(num_bytes: int) -> memoryview:
    buffer = np.empty(num_bytes, dtype=np.uint8)
    buffer.fill(1)  # fault every page in now, not during the first transfer
    return buffer.data


def _starts(sizes: list[int]) -> list[int]:
    """Offset of each bucket in the staging buffer."""
    starts, start = [], 0
    for size in sizes:
        starts.append(start)
        start += _aligned(size)
    return starts


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _plan(manifest: Manifest, endpoint: str) -> tuple[list[BucketHeader], list[_Chunk]]:
    """Decode and check the (checksummed) headers; the chunks to fetch, in bucket order."""
    decoder = msgspec.msgpack.Decoder(BucketHeader)
    headers: list[BucketHeader] = []
    chunks: list[_Chunk] = []
    start = 0
    sizes = manifest.bucket_bytes
    if not len(manifest.headers) == len(sizes) == len(manifest.digests) or manifest.stream_port <= 0:
        raise WeightSyncError(f"malformed manifest from {endpoint} (does the server stream?)")
    for index, (frame, size, digests) in enumerate(zip(manifest.headers, sizes, manifest.digests, strict=True)):
        try:
            header = decoder.decode(frame)
        except msgspec.DecodeError as e:
            raise WeightSyncError(f"undecodable bucket header {index} from {endpoint}: {e}") from e
        num_chunks = max(1, -(-size // header.chunk_bytes))
        if header.version != manifest.version or header.index != index or num_chunks != len(digests):
            raise WeightSyncError(f"bucket header {index} from {endpoint} does not match its manifest")
        headers.append(header)
        for chunk in range(num_chunks):
            offset = chunk * header.chunk_bytes
            chunks.append(_Chunk(index, chunk, start + offset, min(header.chunk_bytes, size - offset)))
        start += _aligned(size)
    return headers, chunks


class _Transfer:
    """The connections of one fetch: worker threads fill the staging buffer and report verified buckets."""

    def __init__(
        self,
        receiver: StreamReceiver,
        endpoint: str,
        manifest: Manifest,
        chunks: list[_Chunk],
        staging: memoryview,
        deadline: float,
        abandoned: threading.Event | None,
    ) -> None:
        self.receiver, self.endpoint, self.manifest = receiver, endpoint, manifest
        self.version = manifest.version
        self.host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        self.chunks, self.staging, self.deadline, self.abandoned = chunks, staging, deadline, abandoned
        self.bucket_starts: list[int] = []
        start = 0
        for size in manifest.bucket_bytes:
            self.bucket_starts.append(start)
            start += _aligned(size)
        self.remaining = [len(d) for d in manifest.digests]
        self.next_chunk = 0
        self.again: deque[_Chunk] = deque()
        """Chunks lost on a connection, fetched again before the next new one."""
        self.tries: dict[tuple[int, int], int] = {}
        """Fetches of a (bucket, chunk) that failed, this version."""
        self.lock = threading.Lock()
        self.events: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(min(self.receiver.num_connections, len(self.chunks))):
            thread = threading.Thread(target=self._work, name=f"weights-stream-{i}", daemon=True)
            self.threads.append(thread)
            thread.start()

    def stop(self) -> None:
        """End the connections (unblocking their threads) and wait for the threads."""
        self.stopping.set()
        with self.lock:
            sockets = list(self.sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self.threads:
            thread.join()
        for sock in self.sockets:  # (a thread may have connected after the snapshot above)
            sock.close()

    def _what(self) -> str:
        return f"weight sync of version {self.version} from {self.endpoint}"

    def verified_buckets(self) -> Iterator[int]:
        """Bucket indices as they verify; raises the first worker error, a missed deadline or an abandon."""
        num_buckets = len(self.remaining)
        for done in range(num_buckets):
            while True:
                if self.abandoned is not None and self.abandoned.is_set():
                    raise WeightSyncError(f"{self._what()} abandoned ({done}/{num_buckets} buckets verified)")
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError(f"{self._what()} missed its deadline ({done}/{num_buckets} buckets verified)")
                try:
                    event = self.events.get(timeout=min(left, ABANDON_POLL_S))
                except queue.Empty:
                    continue
                if isinstance(event, BaseException):
                    raise event
                yield event
                break

    def _take(self) -> _Chunk | None:
        with self.lock:
            if self.again:
                return self.again.popleft()
            if self.next_chunk >= len(self.chunks):
                return None
            self.next_chunk += 1
            return self.chunks[self.next_chunk - 1]

    def _connect(self) -> socket.socket:
        timeout = max(0.01, min(CONNECT_TIMEOUT_S, self.deadline - time.monotonic()))
        try:
            sock = socket.create_connection((self.host, self.manifest.stream_port), timeout=timeout)
        except OSError as e:
            raise WeightSyncError(f"{self._what()}: cannot connect to its chunk port: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # stop() unblocks it; the deadline is the consumer's
        with self.lock:
            self.sockets.append(sock)
        if self.stopping.is_set():
            sock.shutdown(socket.SHUT_RDWR)
        return sock

    def _work(self) -> None:
        lost: _ChunkLostError | None = None
        while not self.stopping.is_set():
            try:
                sock = self._connect()
            except WeightSyncError as e:  # after a lost chunk: the server is gone, not just the connection
                self.events.put(self._gone(lost.reason) if lost is not None else e)
                return
            try:
                self._receive(sock)
                return
            except _ChunkLostError as e:
                lost = e
                if not self._again(e):
                    return
            except WeightSyncError as e:
                self.events.put(e)
                return
            except OSError as e:
                if not self.stopping.is_set():
                    self.events.put(WeightSyncError(f"{self._what()}: the server went away ({e})"))
                return
            finally:
                self._drop(sock)

    def _again(self, lost: _ChunkLostError) -> bool:
        """Queue ``lost``'s chunks to be fetched again (on a new connection); False, with the version's error
        put, when its chunk was tried :data:`CHUNK_TRIES` times."""
        chunk = lost.chunk
        key = (chunk.bucket, chunk.chunk)
        with self.lock:
            tries = self.tries[key] = self.tries.get(key, 0) + 1
            if tries < CHUNK_TRIES:
                self.again.extend([chunk, *lost.pending])
        what = f"{self._what()}: bucket {chunk.bucket} chunk {chunk.chunk} {lost.reason}"
        if tries >= CHUNK_TRIES:
            self.events.put(WeightSyncError(f"{what}, {tries} times; no bucket it belongs to was handed out"))
            return False
        logger.warning("%s: fetching it again (try %d of %d)", what, tries + 1, CHUNK_TRIES)
        return True

    def _drop(self, sock: socket.socket) -> None:
        with self.lock:
            if sock in self.sockets:
                self.sockets.remove(sock)
        sock.close()

    def _receive(self, sock: socket.socket) -> None:
        pending: deque[_Chunk] = deque()
        reply = bytearray(REPLY.size)
        while True:
            while len(pending) < self.receiver.requests_in_flight and (chunk := self._take()) is not None:
                sock.sendall(REQUEST.pack(REQUEST_MAGIC, self.version, chunk.bucket, chunk.chunk))
                pending.append(chunk)
            if not pending:
                return
            chunk = pending.popleft()
            if not recv_exactly(sock, memoryview(reply)):
                raise _ChunkLostError(chunk, list(pending), "was cut short (the connection closed)")
            magic, status, _, length = REPLY.unpack(reply)
            if magic != REPLY_MAGIC:
                raise WeightSyncError(f"{self._what()}: not a weight chunk reply")
            if status != OK:
                message = bytearray(min(length, 4096))
                recv_exactly(sock, memoryview(message))
                raise WeightSyncError(f"weight server {self.endpoint} refused: {message.decode(errors='replace')}")
            if length != chunk.length:
                raise WeightSyncError(f"{self._what()}: chunk {chunk.bucket}/{chunk.chunk} has {length} bytes")
            view = self.staging[chunk.start : chunk.start + chunk.length]
            digest = _receive_hashed(sock, view)
            if digest is None:
                raise _ChunkLostError(chunk, list(pending), "was cut short (the connection closed)")
            if digest != self.manifest.digests[chunk.bucket][chunk.chunk]:
                raise _ChunkLostError(chunk, list(pending), "failed its digest (corrupted in transit)")
            with self.lock:
                self.remaining[chunk.bucket] -= 1
                complete = self.remaining[chunk.bucket] == 0
            if complete:
                self.events.put(chunk.bucket)

    def _gone(self, lost: str = "") -> WeightSyncError:
        with self.lock:
            verified = sum(1 for r in self.remaining if r == 0)
        why = f": a chunk {lost} and a new connection was refused" if lost else ""
        return WeightSyncError(
            f"{self._what()}: the server went away ({verified}/{len(self.remaining)} buckets verified){why}"
        )


def _receive_hashed(sock: socket.socket, view: memoryview) -> bytes | None:
    """Fill ``view`` from ``sock``, hashing each piece as it lands (still in the cache: ~10% faster than
    hashing the whole chunk after it); the blake3 digest, or None when the peer closed first."""
    hasher = blake3.blake3()
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        hasher.update(view[got : got + n])
        got += n
    return hasher.digest()
