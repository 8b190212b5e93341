"""Streaming weight receiver: chunks over several TCP connections, each bucket handed out once verified."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import zmq

from streamrl.common.errors import WeightSyncError
from streamrl.common.weights.chunks import REFUSED, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC, chunk_reply
from streamrl.common.weights.stream import StreamReceiver, VerifiedBucket, stream_buckets
from streamrl.common.weights.wire import (
    CONNECT_TIMEOUT_S,
    BucketServer,
    EncodedVersion,
    WireTensor,
    chunk_digests,
    encode_version,
    fetch_buckets,
    manifest_of,
)

CHUNK = 1024


def _tensors(seed: int = 0) -> list[WireTensor]:
    rng = np.random.default_rng(seed)
    return [
        WireTensor("embed", "bfloat16", rng.integers(0, 2**16, (300, 16), dtype=np.uint16)),  # > a bucket
        WireTensor("layer.0.w", "float32", rng.standard_normal((40, 9)).astype(np.float32)),
        WireTensor("layer.0.b", "float16", rng.standard_normal(9).astype(np.float16)),
        WireTensor("scale", "float32", np.array(2.5, dtype=np.float32)),
        WireTensor("empty", "float32", np.zeros((0, 4), dtype=np.float32)),
        WireTensor("layer.1.w", "bfloat16", rng.integers(0, 2**16, (64, 33), dtype=np.uint16)),
    ]


def _encode(version: int = 1, seed: int = 0) -> EncodedVersion:
    return encode_version(_tensors(seed), version, bucket_bytes=4096, chunk_bytes=CHUNK)


@pytest.fixture
def server() -> Iterator[BucketServer]:
    srv = BucketServer()
    yield srv
    srv.close()


def _collect(buckets: Iterator[VerifiedBucket], into: list[int] | None = None) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for bucket in buckets:
        if into is not None:
            into.append(bucket.bucket)
        out.update((t.name, t.array.copy()) for t in bucket.tensors)
    return out


@pytest.mark.parametrize("num_connections", [1, 3])
def test_tensors_arrive_equal_and_every_bucket_once(server: BucketServer, num_connections: int) -> None:
    encoded = _encode()
    assert len(encoded.buckets) > 2 and any(len(d) > 1 for d in encoded.digests)  # several chunks a bucket
    server.set_current(encoded)
    seen: list[int] = []
    receiver = StreamReceiver(num_connections=num_connections)
    received = _collect(receiver.fetch(server.endpoint, 1, encoded.checksum, 5.0), seen)
    assert sorted(seen) == list(range(len(encoded.buckets)))
    for t in _tensors():
        assert received[t.name].shape == t.array.shape and np.array_equal(received[t.name], t.array)
    # The receiver keeps its staging buffer for the next version.
    server.set_current(encoded2 := _encode(version=2, seed=1))
    received = _collect(receiver.fetch(server.endpoint, 2, encoded2.checksum, 5.0))
    assert all(np.array_equal(received[t.name], t.array) for t in _tensors(seed=1))


def test_the_staging_buffer_can_be_the_callers(server: BucketServer) -> None:
    encoded = _encode()
    server.set_current(encoded)
    buffers: list[bytearray] = []

    def allocate(num_bytes: int) -> memoryview:
        buffers.append(bytearray(num_bytes))
        return memoryview(buffers[-1])

    receiver = StreamReceiver(allocate=allocate)
    for _ in range(2):
        received = _collect(receiver.fetch(server.endpoint, 1, encoded.checksum, 5.0))
        assert all(np.array_equal(received[t.name], t.array) for t in _tensors())
    assert len(buffers) == 1 and bytes(encoded.buckets[0].data[:64]) in buffers[0]
    with pytest.raises(ValueError, match="read-only"):
        StreamReceiver(allocate=lambda n: memoryview(bytes(n))).staging(10)


def test_both_receivers_agree_on_the_checksum(server: BucketServer) -> None:
    encoded = _encode()
    server.set_current(encoded)
    old = {t.name: t.array.copy() for t in fetch_buckets(server.endpoint, 1, encoded.checksum, 5.0)}
    new = _collect(stream_buckets(server.endpoint, 1, encoded.checksum, 5.0))
    assert old.keys() == new.keys() and all(np.array_equal(old[k], new[k]) for k in old)


def test_a_corrupted_chunk_is_refused_and_its_bucket_never_handed_out(server: BucketServer) -> None:
    encoded = _encode()
    bad = len(encoded.buckets) - 1
    encoded.buckets[bad].data[5] ^= 0xFF  # corrupted after the digests were taken (on the wire, say)
    server.set_current(encoded)
    seen: list[int] = []
    with pytest.raises(WeightSyncError, match=f"bucket {bad} chunk 0 failed its digest"):
        _collect(StreamReceiver(num_connections=1).fetch(server.endpoint, 1, encoded.checksum, 5.0), seen)
    assert bad not in seen


def test_a_consistent_forgery_fails_the_signed_checksum(server: BucketServer) -> None:
    """Digests recomputed over changed data make a self-consistent manifest; the event's checksum
    binds the digests, so the receiver refuses it before any data moves."""
    encoded = _encode()
    encoded.buckets[0].data[0] ^= 0xFF
    encoded.digests[0] = chunk_digests(encoded.buckets[0].data, CHUNK)
    server.set_current(encoded)
    seen: list[int] = []
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        _collect(stream_buckets(server.endpoint, 1, encoded.checksum, 5.0), seen)
    assert seen == []


def test_a_version_not_served_is_refused_naming_the_current_one(server: BucketServer) -> None:
    server.set_current(_encode(version=4))
    with pytest.raises(WeightSyncError, match=r"version 3 is not served \(current version: 4\)"):
        list(stream_buckets(server.endpoint, 3, None, 5.0))


def test_chunk_requests_for_another_version_are_refused() -> None:
    encoded = _encode(version=5)
    status, current, message = chunk_reply(REQUEST.pack(REQUEST_MAGIC, 4, 0, 0), encoded)
    assert status == REFUSED and current == 5 and b"version 4 is not served" in bytes(message)
    status, _, message = chunk_reply(REQUEST.pack(REQUEST_MAGIC, 5, 99, 0), encoded)
    assert status == REFUSED and b"out of range" in bytes(message)
    assert chunk_reply(REQUEST.pack(REQUEST_MAGIC, 5, 0, 0), None)[:2] == (REFUSED, -1)
    status, _, data = chunk_reply(REQUEST.pack(REQUEST_MAGIC, 5, 0, 1), encoded)
    assert status == 0 and bytes(data) == bytes(encoded.buckets[0].data[CHUNK : 2 * CHUNK])


class _FakeServer:
    """A manifest over ZMQ (a real version's) and a chunk port whose behaviour the test picks."""

    def __init__(self, encoded: EncodedVersion, answer: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        manifest = msgspec.msgpack.encode(manifest_of(encoded, self.listener.getsockname()[1]))
        self.connections: list[socket.socket] = []

        def serve_manifest() -> None:
            if self.router.poll(10_000):
                identity, _ = self.router.recv_multipart()
                self.router.send_multipart([identity, manifest])

        def serve_chunks() -> None:  # every connection, in turn (a receiver reconnects after a lost chunk)
            while True:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    return
                self.connections.append(conn)
                threading.Thread(target=answer, args=(conn,), daemon=True).start()

        for target in (serve_manifest, serve_chunks):
            threading.Thread(target=target, daemon=True).start()

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.listener.close()
        self.router.close()
        self.ctx.term()


def _truncate(conn: socket.socket) -> None:
    """Answer the first request with half a chunk, then die."""
    conn.recv(REQUEST.size)
    conn.sendall(REPLY.pack(REPLY_MAGIC, 0, 1, CHUNK) + b"\0" * (CHUNK // 2))
    conn.shutdown(socket.SHUT_RDWR)


def _stall(conn: socket.socket) -> None:
    conn.recv(REQUEST.size)  # and never answer


def _serve(encoded: EncodedVersion, spoil: Callable[[int, bytearray], bool]) -> Callable[[socket.socket], None]:
    """A chunk server's answers on one connection; ``spoil(connection, data)`` may change a chunk's data (then
    sent) or return True to cut the connection half-way through it."""
    connections = iter(range(1_000))

    def answer(conn: socket.socket) -> None:
        try:
            serve(conn, next(connections))
        except (ConnectionResetError, BrokenPipeError):  # the receiver hung up on a chunk it refused
            pass

    def serve(conn: socket.socket, number: int) -> None:
        while len(request := conn.recv(REQUEST.size)) == REQUEST.size:
            status, current, data = chunk_reply(request, encoded)
            body = bytearray(data)
            if spoil(number, body):
                conn.sendall(REPLY.pack(REPLY_MAGIC, status, current, len(body)) + bytes(body[: len(body) // 2]))
                conn.shutdown(socket.SHUT_RDWR)
                return
            conn.sendall(REPLY.pack(REPLY_MAGIC, status, current, len(body)) + bytes(body))

    return answer


def _fetched(endpoint: str, encoded: EncodedVersion) -> dict[str, np.ndarray]:
    return _collect(StreamReceiver(num_connections=1).fetch(endpoint, 1, encoded.checksum, 30.0))


def test_a_chunk_cut_short_or_corrupted_once_is_fetched_again_alone() -> None:
    """A dropped connection or a flipped byte costs one chunk, fetched again on a new connection - not the
    version (a 7B version is 15 GB)."""
    encoded = _encode()
    want = {t.name: t.array for t in _tensors()}

    def flip(number: int, body: bytearray) -> bool:
        if number == 0 and body:
            body[0] ^= 0xFF
        return False

    for spoil in (lambda number, body: number == 0, flip):
        fake = _FakeServer(encoded, _serve(encoded, spoil))
        try:
            got = _fetched(fake.endpoint, encoded)
        finally:
            fake.close()
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_chunk_cut_short_on_every_connection_fails_the_version_at_once() -> None:
    fake = _FakeServer(encoded := _encode(), _truncate)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"bucket 0 chunk 0 was cut short .*, 3 times"):
            list(StreamReceiver(num_connections=1).fetch(fake.endpoint, 1, encoded.checksum, 30.0))
    finally:
        fake.close()
    assert time.monotonic() - start < 5.0


def test_a_server_gone_mid_chunk_fails_at_once() -> None:
    """The learner killed mid-transfer: the lost chunk's new connection is refused, and the fetch fails at once
    naming it (not at its deadline)."""
    encoded = _encode()
    fake = _FakeServer(encoded, lambda conn: (_truncate(conn), fake.listener.close()))
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"the server went away \(0/\d+ buckets verified\): a chunk"):
            list(StreamReceiver(num_connections=1).fetch(fake.endpoint, 1, encoded.checksum, 30.0))
    finally:
        fake.close()
    assert time.monotonic() - start < 5.0


def test_a_stalled_transfer_fails_at_its_deadline() -> None:
    fake = _FakeServer(encoded := _encode(), _stall)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"missed its deadline \(0/\d+ buckets verified\)"):
            list(StreamReceiver(num_connections=1).fetch(fake.endpoint, 1, encoded.checksum, 0.5))
    finally:
        fake.close()
    assert 0.45 < time.monotonic() - start < 3.0


def test_an_abandoned_stream_stops() -> None:
    fake = _FakeServer(encoded := _encode(), _stall)
    abandoned = threading.Event()
    threading.Timer(0.3, abandoned.set).start()
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="abandoned"):
            list(StreamReceiver(num_connections=1).fetch(fake.endpoint, 1, encoded.checksum, 60.0, abandoned))
    finally:
        fake.close()
    assert time.monotonic() - start < 3.0


def test_a_killed_server_fails_the_stream_mid_transfer() -> None:
    """The learner dies while the chunks flow: the receiver errors well within its deadline and has
    handed out no bucket that did not verify."""
    big = [WireTensor(f"w{i}", "bfloat16", np.full(1 << 20, i, dtype=np.uint16)) for i in range(48)]  # 96 MiB
    encoded = encode_version(big, 1, bucket_bytes=4 << 20, chunk_bytes=1 << 20)
    server = BucketServer()
    server.set_current(encoded)
    serve = server._get_current

    def slowly() -> EncodedVersion | None:  # 5 ms a chunk: the transfer is still going when it dies
        time.sleep(0.005)
        return serve()

    server._chunks._get_current = slowly
    seen: list[int] = []
    start = time.monotonic()
    buckets = StreamReceiver(num_connections=2).fetch(server.endpoint, 1, encoded.checksum, 60.0)
    with pytest.raises(WeightSyncError, match=r"went away|cannot connect"):
        for bucket in buckets:
            seen.append(bucket.bucket)
            if len(seen) == 1:
                server.close()
            assert all(np.all(t.array == int(t.name[1:])) for t in bucket.tensors)
    assert len(seen) < len(encoded.buckets)
    assert time.monotonic() - start < 10.0


def test_a_dead_server_fails_at_the_connect_deadline() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="did not answer the connection"):
        list(stream_buckets(dead, 1, None, 60.0))
    assert time.monotonic() - start < CONNECT_TIMEOUT_S + 3.0


def test_headers_bind_the_chunk_size() -> None:
    header = msgspec.msgpack.decode(_encode().buckets[0].header)
    assert header["chunk_bytes"] == CHUNK
    assert struct.calcsize("<4sqii") == REQUEST.size


def test_a_fixed_weight_port_puts_the_chunk_stream_on_the_next_one() -> None:
    """Operators open (and proxies forward) weights_port and weights_port + 1; a taken next port is refused by name."""

    def port_with_next(taken: bool) -> tuple[int, socket.socket | None]:
        for _ in range(100):
            with socket.create_server(("127.0.0.1", 0)) as probe:
                port = probe.getsockname()[1]
            try:
                nxt = socket.create_server(("127.0.0.1", port + 1))
            except OSError:
                continue
            if taken:
                return port, nxt
            nxt.close()
            return port, None
        raise AssertionError("no two free ports in a row")

    port, _ = port_with_next(taken=False)
    server = BucketServer(port=port)
    try:
        assert server.stream_port == port + 1
    finally:
        server.close()
    port, holder = port_with_next(taken=True)
    assert holder is not None
    with holder, pytest.raises(OSError, match=rf"chunk stream cannot listen on 127.0.0.1:{port + 1}"):
        BucketServer(port=port)
