"""Bucketed weight wire protocol: packing, checksum, pull server, receiver errors (numpy only)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from streamrl.common.errors import WeightSyncError
from streamrl.common.weights.wire import (
    ALIGN_BYTES,
    CONNECT_TIMEOUT_S,
    WIRE_PROTOCOL,
    BucketHeader,
    BucketServer,
    ErrorReply,
    WireTensor,
    encode_version,
    fetch_buckets,
    serve_request,
)


def _tensors(seed: int = 0) -> list[WireTensor]:
    rng = np.random.default_rng(seed)
    return [
        WireTensor("embed", "float32", rng.standard_normal((50, 16)).astype(np.float32)),
        WireTensor("layer.0.w", "bfloat16", rng.integers(0, 2**16, (7, 9), dtype=np.uint16)),
        WireTensor("layer.0.b", "float16", rng.standard_normal(9).astype(np.float16)),
        WireTensor("scale", "float32", np.array(2.5, dtype=np.float32)),
        WireTensor("steps", "int64", np.arange(3, dtype=np.int64)),
        WireTensor("big", "float32", rng.standard_normal((40, 40)).astype(np.float32)),
    ]


@pytest.fixture
def server() -> Iterator[BucketServer]:
    srv = BucketServer()
    yield srv
    srv.close()


def test_buckets_respect_size_alignment_and_order() -> None:
    tensors = _tensors()
    encoded = encode_version(tensors, version=3, bucket_bytes=4096)
    headers = [msgspec.msgpack.decode(b.header, type=BucketHeader) for b in encoded.buckets]
    assert [e.name for h in headers for e in h.tensors] == [t.name for t in tensors]
    assert all(h.num_buckets == len(encoded.buckets) and h.version == 3 for h in headers)
    assert [h.index for h in headers] == list(range(len(headers)))
    for header, bucket in zip(headers, encoded.buckets, strict=True):
        assert all(e.offset % ALIGN_BYTES == 0 for e in header.tensors)
        # A bucket only exceeds the target when it holds one oversized tensor.
        assert len(bucket.data) <= 4096 or len(header.tensors) == 1
    assert any(len(h.tensors) == 1 and h.tensors[0].name == "big" for h in headers)  # 6400 bytes > 4096
    assert encoded.num_bytes == sum(t.array.nbytes for t in tensors)


def test_checksum_is_deterministic_and_covers_every_byte() -> None:
    a = encode_version(_tensors(), version=1, bucket_bytes=4096)
    assert encode_version(_tensors(), version=1, bucket_bytes=4096).checksum == a.checksum
    changed = _tensors()
    changed[3] = WireTensor("scale", "float32", np.array(2.5000002, dtype=np.float32))
    assert encode_version(changed, version=1, bucket_bytes=4096).checksum != a.checksum
    renamed = _tensors()
    renamed[4] = WireTensor("steps2", "int64", renamed[4].array)
    assert encode_version(renamed, version=1, bucket_bytes=4096).checksum != a.checksum


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        encode_version([_tensors()[0], _tensors()[0]], version=1)
    with pytest.raises(ValueError, match="at least one"):
        encode_version([], version=1)


def test_serve_request_errors_name_the_current_version() -> None:
    encoded = encode_version(_tensors(), version=5, bucket_bytes=4096)
    decode = msgspec.msgpack.Decoder(BucketHeader | ErrorReply).decode
    stale = decode(
        serve_request(
            msgspec.msgpack.encode({"type": "get", "version": 4, "index": 0, "protocol": WIRE_PROTOCOL}), encoded
        )[0]
    )
    assert isinstance(stale, ErrorReply) and stale.current_version == 5 and "version 4" in stale.message
    nothing = decode(
        serve_request(
            msgspec.msgpack.encode({"type": "get", "version": 0, "index": 0, "protocol": WIRE_PROTOCOL}), None
        )[0]
    )
    assert isinstance(nothing, ErrorReply) and nothing.current_version == -1
    out_of_range = decode(
        serve_request(
            msgspec.msgpack.encode({"type": "get", "version": 5, "index": 99, "protocol": WIRE_PROTOCOL}), encoded
        )[0]
    )
    assert isinstance(out_of_range, ErrorReply) and "out of range" in out_of_range.message
    garbage = decode(serve_request(b"\xc1not msgpack", encoded)[0])
    assert isinstance(garbage, ErrorReply) and "undecodable" in garbage.message


def test_headers_are_plain_msgpack() -> None:
    msgpack = pytest.importorskip("msgpack")
    header = msgpack.unpackb(encode_version(_tensors(), version=2).buckets[0].header)
    assert header["type"] == "bucket" and header["version"] == 2
    assert header["tensors"][1] == {
        "name": "layer.0.w",
        "dtype": "bfloat16",
        "shape": [7, 9],
        "offset": 3200,
        "nbytes": 126,
    }


def test_fetch_round_trip_with_concurrent_receivers(server: BucketServer) -> None:
    tensors = _tensors()
    encoded = encode_version(tensors, version=7, bucket_bytes=2048)
    server.set_current(encoded)
    results: list[list[tuple[str, str, np.ndarray]]] = []

    def receive() -> None:
        results.append(
            [(t.name, t.dtype, t.array.copy()) for t in fetch_buckets(server.endpoint, 7, encoded.checksum, 5.0)]
        )

    threads = [threading.Thread(target=receive) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3
    for received in results:
        assert [(n, d) for n, d, _ in received] == [(t.name, t.dtype) for t in tensors]
        for (_, _, array), sent in zip(received, tensors, strict=True):
            assert array.shape == sent.array.shape
            assert np.array_equal(array, sent.array)


def test_wrong_checksum_yields_nothing(server: BucketServer) -> None:
    encoded = encode_version(_tensors(), version=1, bucket_bytes=2048)
    server.set_current(encoded)
    received = fetch_buckets(server.endpoint, 1, "0" * 64, 5.0)
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        next(received)


def test_stale_version_request_fails_with_the_current_version(server: BucketServer) -> None:
    server.set_current(encode_version(_tensors(), version=4))
    with pytest.raises(WeightSyncError, match=r"version 3 is not served \(current version: 4\)"):
        list(fetch_buckets(server.endpoint, 3, None, 5.0))
    assert server.current_version == 4


def test_unreachable_endpoint_fails_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="deadline"):
        list(fetch_buckets("tcp://127.0.0.1:9", 1, None, 0.3))
    assert 0.25 < time.monotonic() - start < 2.0


def _silent_server() -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes], str]:
    """A ROUTER that accepts connections and never answers (a stalled weight server)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return ctx, sock, f"tcp://127.0.0.1:{port}"


def test_a_dead_server_fails_at_the_connect_deadline_not_the_sync_deadline() -> None:
    """A learner killed right after it published: nothing listens on its endpoint any more. The fetch
    fails within CONNECT_TIMEOUT_S, not at the (here 60 s) sync deadline."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # the port is free: connections are refused, as to a killed learner's
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="did not answer the connection"):
        list(fetch_buckets(dead, 1, None, 60.0))
    assert time.monotonic() - start < CONNECT_TIMEOUT_S + 3.0


def test_a_server_that_goes_away_mid_transfer_fails_the_fetch_at_once() -> None:
    ctx, sock, endpoint = _silent_server()
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            list(fetch_buckets(endpoint, 1, None, 60.0))
        except WeightSyncError as e:
            errors.append(e)

    receiver = threading.Thread(target=fetch)
    receiver.start()
    assert sock.poll(10_000), "the receiver asked for its first bucket"
    sock.recv_multipart()
    start = time.monotonic()
    sock.close()  # the learner dies holding the request
    ctx.term()
    receiver.join(timeout=30)
    assert not receiver.is_alive()
    assert time.monotonic() - start < 5.0
    assert len(errors) == 1 and "the server went away (0/? buckets received)" in str(errors[0])


def test_an_abandoned_fetch_stops_waiting() -> None:
    ctx, sock, endpoint = _silent_server()
    abandoned = threading.Event()
    threading.Timer(0.3, abandoned.set).start()
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="abandoned"):
            list(fetch_buckets(endpoint, 1, None, 60.0, abandoned=abandoned))
    finally:
        sock.close()
        ctx.term()
    assert time.monotonic() - start < 3.0
