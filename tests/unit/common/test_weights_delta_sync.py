"""Delta sync over the real weight server and streaming receiver (sockets, threads): a receiver that
holds a verified earlier version gets only what changed, checked against the new version's digests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from streamrl.common.errors import WeightSyncError
from streamrl.common.weights import wire
from streamrl.common.weights.delta import DeltaHistory, Link, apply_version_delta, encode_version_delta
from streamrl.common.weights.stream import StreamReceiver
from streamrl.common.weights.wire import (
    WIRE_PROTOCOL,
    BucketServer,
    EncodedVersion,
    ErrorReply,
    Manifest,
    WireTensor,
    delta_link,
    encode_version,
    fetch_manifest,
    manifest_of,
)

SHAPES = {"embed": (300, 64), "layer.0.q": (64, 64), "layer.0.norm": (64,), "layer.1.q": (64, 64)}


def _base(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {name: rng.integers(0, 2**16, shape, dtype=np.uint16) for name, shape in SHAPES.items()}
    out["scale"] = rng.standard_normal(4).astype(np.float32)
    return out


def _step(weights: dict[str, np.ndarray], seed: int, fraction: float = 0.02) -> dict[str, np.ndarray]:
    """``fraction`` of the bf16 words move by one ulp (what an optimizer step does); fp32 all move."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, w in weights.items():
        new = w.copy()
        if w.dtype == np.uint16:
            flat = new.reshape(-1)
            flat[rng.random(flat.size) < fraction] += 1
        else:
            new += np.float32(1e-3)
        out[name] = new
    return out


def _wire(weights: dict[str, np.ndarray]) -> list[WireTensor]:
    return [WireTensor(n, "bfloat16" if w.dtype == np.uint16 else str(w.dtype), w) for n, w in weights.items()]


def _encode(weights: dict[str, np.ndarray], version: int) -> EncodedVersion:
    return encode_version(_wire(weights), version, bucket_bytes=16384, chunk_bytes=4096)


def _versions(n: int) -> list[dict[str, np.ndarray]]:
    out = [_base()]
    for v in range(1, n):
        out.append(_step(out[-1], seed=v))
    return out


def _fetch(receiver: StreamReceiver, server: BucketServer, encoded: EncodedVersion) -> dict[str, np.ndarray]:
    got: dict[str, np.ndarray] = {}
    for bucket in receiver.fetch(server.endpoint, encoded.version, encoded.checksum, timeout_s=20):
        got.update({t.name: t.array.copy() for t in bucket.tensors})
    return got


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        assert np.array_equal(got[name], w), name


@pytest.fixture
def server() -> Iterator[BucketServer]:
    srv = BucketServer(max_behind=4)
    yield srv
    srv.close()


@pytest.mark.parametrize("behind", [1, 3])
def test_a_receiver_one_or_k_versions_behind_gets_the_delta(server: BucketServer, behind: int) -> None:
    versions = _versions(1 + behind)
    encoded = [_encode(w, v) for v, w in enumerate(versions)]
    receiver = StreamReceiver(num_connections=2)
    server.set_current(encoded[0])
    _assert_equal(_fetch(receiver, server, encoded[0]), versions[0])
    assert receiver.last is not None and receiver.last.kind == "full"
    for e in encoded[1:]:
        server.set_current(e)  # the receiver sleeps through these
    _assert_equal(_fetch(receiver, server, encoded[-1]), versions[-1])
    last = receiver.last
    assert last is not None and last.kind == "delta" and last.base_version == 0 and last.version == behind
    assert last.num_bytes < 0.25 * last.full_bytes  # 2% of the words changed
    # and the next version, one behind, as a delta again
    nxt = _step(versions[-1], seed=99)
    server.set_current(_encode(nxt, behind + 1))
    _assert_equal(_fetch(receiver, server, _encode(nxt, behind + 1)), nxt)
    assert receiver.last is not None and receiver.last.kind == "delta" and receiver.last.base_version == behind


def test_a_receiver_too_far_behind_gets_the_full_version() -> None:
    server = BucketServer(max_behind=2)
    try:
        versions = _versions(5)
        encoded = [_encode(w, v) for v, w in enumerate(versions)]
        receiver = StreamReceiver(num_connections=2)
        server.set_current(encoded[0])
        _fetch(receiver, server, encoded[0])
        for e in encoded[1:]:
            server.set_current(e)
        _assert_equal(_fetch(receiver, server, encoded[-1]), versions[-1])
        last = receiver.last
        assert last is not None and last.kind == "full" and "too far behind" in last.reason
        assert last.num_bytes == last.full_bytes
    finally:
        server.close()


def test_a_server_that_keeps_no_deltas_serves_full_versions() -> None:
    server = BucketServer(max_behind=0)
    try:
        versions = _versions(2)
        receiver = StreamReceiver(num_connections=1)
        for v, w in enumerate(versions):
            server.set_current(_encode(w, v))
            _assert_equal(_fetch(receiver, server, _encode(w, v)), w)
        assert receiver.last is not None and receiver.last.kind == "full" and "no delta" in receiver.last.reason
        assert server.delta_bytes == 0
    finally:
        server.close()


def _forged(server: BucketServer, data: bytes) -> None:
    """Replace the link the server serves (its history holds the one from version 0 to 1)."""
    links = server._deltas.links
    links[-1] = Link(links[-1].base_version, links[-1].base_checksum, links[-1].version, data)


@pytest.mark.parametrize("forgery", ["consistent", "garbled"])
def test_a_delta_that_fails_its_check_is_never_yielded_and_the_full_version_follows(
    server: BucketServer, forgery: str, caplog: pytest.LogCaptureFixture
) -> None:
    versions = _versions(2)
    encoded = [_encode(w, v) for v, w in enumerate(versions)]
    receiver = StreamReceiver(num_connections=2)
    server.set_current(encoded[0])
    _fetch(receiver, server, encoded[0])
    server.set_current(encoded[1])
    server.wait_deltas()
    link = server._deltas.links[-1]
    if forgery == "consistent":  # a well-formed delta to other weights: only the digests catch it
        other = _encode(_step(versions[0], seed=1234), 1)
        data = delta_link(encoded[0], other)
        assert data is not None
        _forged(server, data.data)
    else:  # a flipped byte in the compressed payload
        garbled = bytearray(link.data)
        garbled[-8] ^= 0xFF
        _forged(server, bytes(garbled))
    seen: list[dict[str, np.ndarray]] = []
    for bucket in receiver.fetch(server.endpoint, 1, encoded[1].checksum, timeout_s=20):
        seen.append({t.name: t.array.copy() for t in bucket.tensors})
    got = {k: v for part in seen for k, v in part.items()}
    _assert_equal(got, versions[1])  # every bucket yielded is the real version 1
    last = receiver.last
    assert last is not None and last.kind == "full" and last.reason.startswith("delta failed")
    assert any("fetching the full version" in r.getMessage() for r in caplog.records)


def test_a_released_receiver_gets_the_full_version(server: BucketServer) -> None:
    versions = _versions(2)
    encoded = [_encode(w, v) for v, w in enumerate(versions)]
    receiver = StreamReceiver(num_connections=2)
    server.set_current(encoded[0])
    _fetch(receiver, server, encoded[0])
    receiver.release()
    server.set_current(encoded[1])
    _assert_equal(_fetch(receiver, server, encoded[1]), versions[1])
    assert (
        receiver.last is not None
        and receiver.last.kind == "full"
        and receiver.last.reason == "no verified version held"
    )


def test_a_fetch_cut_short_leaves_nothing_held(server: BucketServer) -> None:
    versions = _versions(3)
    encoded = [_encode(w, v) for v, w in enumerate(versions)]
    receiver = StreamReceiver(num_connections=1)
    server.set_current(encoded[0])
    _fetch(receiver, server, encoded[0])
    server.set_current(encoded[1])
    fetch = receiver.fetch(server.endpoint, 1, encoded[1].checksum, timeout_s=20)
    next(fetch)  # the engine stops after one bucket: the staging buffer is neither version now
    fetch.close()
    server.set_current(encoded[2])
    _assert_equal(_fetch(receiver, server, encoded[2]), versions[2])
    assert receiver.last is not None and receiver.last.kind == "full"


def test_a_new_layout_restarts_the_chain(server: BucketServer) -> None:
    versions = _versions(2)
    receiver = StreamReceiver(num_connections=1)
    server.set_current(_encode(versions[0], 0))
    _fetch(receiver, server, _encode(versions[0], 0))
    grown = {**versions[1], "extra": np.zeros(8, dtype=np.uint16)}
    server.set_current(_encode(grown, 1))
    server.wait_deltas()
    assert server.delta_bytes == 0
    _assert_equal(_fetch(receiver, server, _encode(grown, 1)), grown)
    assert receiver.last is not None and receiver.last.kind == "full" and "layout" in receiver.last.reason


def test_an_old_protocol_receiver_is_refused_naming_both_versions(server: BucketServer) -> None:
    server.set_current(_encode(_base(), 0))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(server.endpoint)
        sock.send(msgspec.msgpack.encode({"type": "manifest_get", "version": 0}))  # a protocol-1 receiver
        reply = msgspec.msgpack.Decoder(ErrorReply).decode(sock.recv())
    finally:
        sock.close()
    assert f"wire protocol {WIRE_PROTOCOL}" in reply.message and "protocol 1" in reply.message


def test_a_receiver_refuses_an_old_protocol_server_naming_both_versions() -> None:
    encoded = _encode(_base(), 0)
    old = manifest_of(encoded, stream_port=1)
    old_manifest = msgspec.structs.replace(old, protocol=1)
    assert isinstance(old_manifest, Manifest)
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if router.poll(5000):
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, msgspec.msgpack.encode(old_manifest)])

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(WeightSyncError, match=f"speaks wire protocol 1, this receiver protocol {WIRE_PROTOCOL}"):
            fetch_manifest(f"tcp://127.0.0.1:{port}", 0, encoded.checksum, deadline=float("inf"))
    finally:
        thread.join()
        router.close()


def test_a_link_round_trips_and_names_its_versions() -> None:
    versions = _versions(2)
    old, new = _encode(versions[0], 3), _encode(versions[1], 4)
    link = delta_link(old, new)
    assert link is not None and (link.base_version, link.version, link.base_checksum) == (3, 4, old.checksum)
    buckets = [memoryview(bytearray(b.data)) for b in old.buckets]
    assert apply_version_delta(buckets, link.data) == (3, 4)
    assert [bytes(b) for b in buckets] == [bytes(b.data) for b in new.buckets]
    unchanged = encode_version_delta(4, 5, [], [], [])
    assert apply_version_delta([], unchanged) == (4, 5)


def test_a_delta_request_waits_for_its_link_and_the_publish_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    server = BucketServer(max_behind=4)
    release = threading.Event()

    def slow_link(old: EncodedVersion, new: EncodedVersion) -> Link | None:
        release.wait(10)
        return delta_link(old, new)

    try:
        versions = _versions(2)
        receiver = StreamReceiver(num_connections=1)
        server.set_current(_encode(versions[0], 0))
        _fetch(receiver, server, _encode(versions[0], 0))
        monkeypatch.setattr(wire, "delta_link", slow_link)
        server.set_current(_encode(versions[1], 1))  # returns while the link is still being encoded
        threading.Timer(0.3, release.set).start()
        _assert_equal(_fetch(receiver, server, _encode(versions[1], 1)), versions[1])
        assert release.is_set() and receiver.last is not None and receiver.last.kind == "delta"
    finally:
        release.set()
        server.close()


def test_the_history_is_bounded_by_links_and_bytes() -> None:
    history = DeltaHistory(max_behind=2, max_fraction=0.5)
    for v in range(1, 5):
        history.add(Link(v - 1, f"c{v - 1}", v, b"x" * 10), full_bytes=100)
    assert [link.version for link in history.links] == [3, 4]
    assert history.chain(2, "c2", 4) == history.links
    assert "too far behind" in str(history.chain(1, "c1", 4))
    assert "another checksum" in str(history.chain(2, "other", 4))
    history.add(Link(4, "c4", 5, b"x" * 60), full_bytes=100)  # alone above half the model: not kept
    assert history.links == [] and history.num_bytes == 0
    history.add(Link(7, "c7", 8, b"x"), full_bytes=100)
    history.add(None, full_bytes=100)
    assert history.links == []
