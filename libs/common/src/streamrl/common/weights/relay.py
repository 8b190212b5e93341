"""Relay of one weights version through its receivers: a pipelined chain (or tree) of chunks over TCP.

The source sends each chunk once to its first receiver(s); every receiver forwards each chunk
downstream as soon as it holds and has verified it, while later chunks are still arriving, so the
source's bytes per update stay ~1x the model whatever the number of receivers, and the time to the
last receiver grows with ``N x chunk time``, not ``N x model size`` (docs/scaling.md).

* Who forwards to whom comes from the caller: ``order[0]`` is the source, ``order[i]`` the i-th
  receiver, and :func:`upstreams` gives receiver i its parent (``fanout`` 1: a chain; k: a k-ary
  tree; >= N: the naive star) then its earlier holders up to the source, nearest first. The
  coordinator's registry of who holds what would supply ``order``.
* Integrity: a :class:`Manifest` lists a blake2b digest per fixed-size chunk, and one checksum over
  version, sizes and every digest authenticates the list (keyed with the run's weights key when it
  has one; the checksum is what the signed ``WeightsPublished`` event would carry). A chunk is
  verified before it is forwarded or counted as held, so a corrupted chunk is never served.
* Faults: an upstream that closes, stalls past ``stall_s`` or sends a chunk that fails its digest is
  dropped, and the receiver resumes from the next earlier holder at its first missing chunk; when
  none is left, or past ``deadline_s``, :class:`RelayError` names every upstream that failed.

Speed: a receiver's cost is receiving, one blake2b pass and forwarding each byte (about 2.2 CPU s per
GB measured); ``digest_threads`` verifies chunks in a thread pool while later ones arrive, which is
what a host needs to keep up with a fast link (docs/scaling.md, "Weights to many workers").

Simplifications: one version per node at a time (a node serves the version it fetched last); the
payload is one flat buffer (the buckets' layout travels elsewhere); no torch, no copies beyond
``recv_into`` into one preallocated buffer and ``sendall`` of slices of it.
"""

from __future__ import annotations

import functools
import hashlib
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

Address = tuple[str, int]

_MAGIC = b"SRL1"
_REQUEST = struct.Struct("!4sQI")  # magic, version, first chunk wanted
_HEADER = struct.Struct("!4sQQII")  # magic, version, total bytes, chunk bytes, number of chunks
_DIGEST_BYTES = 16
ABANDON_POLL_S = 0.1
"""How often a fetch given an ``abandoned`` event looks at it while it waits for bytes (s)."""


class RelayError(RuntimeError):
    """A receiver could not complete a version: every upstream it tried failed, or time ran out."""


class RelayAbandonedError(RelayError):
    """The caller gave the fetch up (its ``abandoned`` event was set): no other upstream is tried."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a version is: its size, its chunking and one digest per chunk."""

    version: int
    total_bytes: int
    chunk_bytes: int
    digests: bytes  # _DIGEST_BYTES per chunk, in order

    @property
    def num_chunks(self) -> int:
        return len(self.digests) // _DIGEST_BYTES

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def checksum(self, key: bytes = b"") -> str:
        """One hex checksum over version, sizes and every chunk digest (keyed: a signature)."""
        h = hashlib.blake2b(digest_size=32, key=key)
        h.update(_HEADER.pack(_MAGIC, self.version, self.total_bytes, self.chunk_bytes, self.num_chunks))
        h.update(self.digests)
        return h.hexdigest()


def _digest(data: memoryview | bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def build_manifest(version: int, data: memoryview | bytes, chunk_bytes: int) -> Manifest:
    """The manifest of ``data`` cut into ``chunk_bytes`` chunks (the last one may be shorter)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    view = memoryview(data).cast("B")
    digests = b"".join(_digest(view[i : i + chunk_bytes]) for i in range(0, max(len(view), 1), chunk_bytes))
    return Manifest(version, len(view), chunk_bytes, digests)


def upstreams(order: list[Address], index: int, fanout: int = 1) -> list[Address]:
    """Receiver ``index`` (1-based in ``order``; ``order[0]`` is the source): its parent, then the
    parent's ancestors it falls back to, nearest first, ending with the source."""
    assert 1 <= index < len(order) and fanout >= 1
    chain: list[Address] = []
    node = index
    while node > 0:
        node = (node - 1) // fanout
        chain.append(order[node])
    return chain


class RelayNode:
    """Holds (or fetches) one version in one buffer and serves its verified chunks to any number
    of downstream connections, each from the chunk it asks for, as the chunks arrive."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, stall_s: float = 10.0, digest_threads: int = 0) -> None:
        """``digest_threads`` > 0 verifies chunks in that many threads while later chunks are received
        (``hashlib`` releases the GIL); 0 verifies each chunk inline before receiving the next."""
        self.stall_s = stall_s
        self._digest_threads = digest_threads
        self._digests = ThreadPoolExecutor(digest_threads, "relay-digest") if digest_threads > 0 else None
        self.bytes_sent = 0
        self._cond = threading.Condition()
        self._manifest: Manifest | None = None
        self._buffer = memoryview(bytearray(0))
        self._held = 0  # verified chunks, a prefix
        self._closed = False
        self._listener = socket.create_server((host, port), backlog=256)
        self.address: Address = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    # -- holding ---------------------------------------------------------------------------------

    def hold(self, manifest: Manifest, data: memoryview | bytes) -> None:
        """Serve ``data`` (the source, or a node that already has the version); verified here."""
        view = memoryview(data).cast("B")
        if build_manifest(manifest.version, view, manifest.chunk_bytes) != manifest:
            raise ValueError("data does not match its manifest")
        with self._cond:
            self._manifest, self._buffer, self._held = manifest, view, manifest.num_chunks
            self._cond.notify_all()

    def fetch(
        self,
        version: int,
        checksum: str,
        sources: list[Address],
        deadline_s: float,
        key: bytes = b"",
        abandoned: threading.Event | None = None,
    ) -> memoryview:
        """Receive ``version`` (whose manifest must match ``checksum``) from ``sources`` in turn,
        forwarding verified chunks downstream meanwhile; returns the verified buffer (at once when this
        node holds that version whole already). ``abandoned`` set stops it between two chunks
        (:class:`RelayAbandonedError`)."""
        with self._cond:
            if self._complete(version, checksum, key):
                return self._buffer
        deadline = time.monotonic() + deadline_s
        failures: list[str] = []
        for upstream in sources:
            if time.monotonic() >= deadline:
                break
            if abandoned is not None and abandoned.is_set():
                raise RelayAbandonedError(f"version {version}: abandoned")
            try:
                self._fetch_from(upstream, version, checksum, key, deadline, abandoned)
                return self._buffer
            except RelayAbandonedError:
                raise
            except (OSError, RelayError) as exc:
                failures.append(f"{upstream[0]}:{upstream[1]} ({exc})")
        with self._cond:
            held, total = self._held, self._manifest.num_chunks if self._manifest else "?"
        raise RelayError(
            f"version {version}: {held}/{total} chunks after {deadline_s:.1f} s deadline or no upstream left; "
            f"failed upstreams: {'; '.join(failures) or 'none tried'}"
        )

    def _complete(self, version: int, checksum: str, key: bytes) -> bool:
        """Whether this node holds ``version`` whole, with ``checksum`` (call under ``_cond``)."""
        m = self._manifest
        return m is not None and m.version == version and self._held == m.num_chunks and m.checksum(key) == checksum

    def _fetch_from(
        self,
        upstream: Address,
        version: int,
        checksum: str,
        key: bytes,
        deadline: float,
        abandoned: threading.Event | None = None,
    ) -> None:
        def arm(sock: socket.socket) -> float:
            """The wait allowed for the next bytes (the stall limit, within the deadline); with ``abandoned``
            the socket wakes every ABANDON_POLL_S to look at it."""
            budget = max(0.01, min(self.stall_s, deadline - time.monotonic()))
            sock.settimeout(min(budget, ABANDON_POLL_S) if abandoned is not None else budget)
            return budget

        timeout = max(0.01, min(self.stall_s, deadline - time.monotonic()))
        with socket.create_connection(upstream, timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:  # resume after the verified chunks of this very version (same checksum) only
                m = self._manifest
                first = self._held if m is not None and m.version == version and m.checksum(key) == checksum else 0
            sock.sendall(_REQUEST.pack(_MAGIC, version, first))
            header = _recv_exact(sock, _HEADER.size, arm(sock), abandoned)
            magic, got_version, total, chunk_bytes, num_chunks = _HEADER.unpack(header)
            if magic != _MAGIC or got_version != version:
                raise RelayError(f"upstream serves version {got_version}, not {version}")
            digests = _recv_exact(sock, num_chunks * _DIGEST_BYTES, arm(sock), abandoned)
            manifest = Manifest(version, total, chunk_bytes, digests)
            if manifest.checksum(key) != checksum:
                raise RelayError("manifest checksum mismatch")
            with self._cond:
                if self._manifest != manifest:  # first upstream of this version: allocate once
                    if first:
                        raise RelayError("the manifest changed mid-version")
                    self._manifest, self._buffer, self._held = manifest, memoryview(bytearray(total)), 0
                    self._cond.notify_all()
            pending: deque[tuple[int, Future[bytes]]] = deque()  # received, being verified, in order
            try:
                for index in range(first, num_chunks):
                    if abandoned is not None and abandoned.is_set():
                        raise RelayAbandonedError(f"version {version}: abandoned at chunk {index}/{num_chunks}")
                    budget = arm(sock)
                    start, end = manifest.chunk_range(index)
                    chunk = self._buffer[start:end]
                    _recv_into_exact(sock, chunk, budget, abandoned)
                    if self._digests is None:
                        self._verified(manifest, index, _digest(chunk))
                        continue
                    pending.append((index, self._digests.submit(_digest, chunk)))
                    while pending and (pending[0][1].done() or len(pending) > 2 * self._digest_threads):
                        done, future = pending.popleft()
                        self._verified(manifest, done, future.result())
            finally:  # chunks received whole before a failure still count: the next upstream resumes after them
                for done, future in pending:
                    if done != self._held:  # after a chunk that failed its digest: nothing later counts
                        break
                    self._verified(manifest, done, future.result())

    def _verified(self, manifest: Manifest, index: int, digest: bytes) -> None:
        """Chunk ``index`` counts as held (and is served onward) only if its digest matches."""
        if digest != manifest.digests[index * _DIGEST_BYTES : (index + 1) * _DIGEST_BYTES]:
            raise RelayError(f"chunk {index} failed its digest")
        with self._cond:
            self._held = index + 1
            self._cond.notify_all()

    # -- serving ---------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="relay-serve").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self.stall_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                magic, version, first = _REQUEST.unpack(_recv_exact(conn, _REQUEST.size))
                if magic != _MAGIC:
                    return
                # wait for this version; a node that holds a newer one already will never serve it: at once
                manifest = self._wait(lambda: self._manifest is not None and self._manifest.version >= version)
                if manifest is None or manifest.version != version:
                    return
                conn.sendall(
                    _HEADER.pack(_MAGIC, version, manifest.total_bytes, manifest.chunk_bytes, manifest.num_chunks)
                )
                conn.sendall(manifest.digests)
                for index in range(first, manifest.num_chunks):
                    if self._wait(functools.partial(self._holds, manifest, index)) is None:
                        return
                    start, end = manifest.chunk_range(index)
                    conn.sendall(self._buffer[start:end])
                    with self._cond:
                        self.bytes_sent += end - start
            except (OSError, RelayError):
                return  # the downstream went away or stalled (or hung up before asking): it re-sources itself

    def _holds(self, manifest: Manifest, index: int) -> bool:
        return self._manifest is manifest and self._held > index

    def _wait(self, ready: Callable[[], bool]) -> Manifest | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or ready(), timeout=self.stall_s) or self._closed:
                return None
            return self._manifest

    def close(self) -> None:
        """Stop serving: downstream connections see the close and re-source."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        if self._digests is not None:
            self._digests.shutdown(wait=False, cancel_futures=True)


def _recv_exact(
    sock: socket.socket, size: int, stall_s: float | None = None, abandoned: threading.Event | None = None
) -> bytes:
    buffer = bytearray(size)
    _recv_into_exact(sock, memoryview(buffer), stall_s, abandoned)
    return bytes(buffer)


def _recv_into_exact(
    sock: socket.socket, view: memoryview, stall_s: float | None = None, abandoned: threading.Event | None = None
) -> None:
    """Fill ``view``; a socket time-out shorter than ``stall_s`` (a poll for ``abandoned``) is waited out until
    ``stall_s`` passes without a byte."""
    got = 0
    quiet_since = time.monotonic()
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if abandoned is not None and abandoned.is_set():
                raise RelayAbandonedError(f"abandoned after {got} of {len(view)} bytes") from None
            if stall_s is None or time.monotonic() - quiet_since >= stall_s:
                raise
            continue
        if n == 0:
            raise RelayError(f"upstream closed after {got} of {len(view)} bytes")
        got += n
        quiet_since = time.monotonic()
