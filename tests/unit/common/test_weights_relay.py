"""The weights relay (streamrl.common.weights.relay) on loopback threads: chains and trees deliver
verified bytes with the source sending each chunk once per child, and a dead, stalled or lying
upstream is dropped for an earlier holder, or named in the error within the deadline."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from streamrl.common.weights import relay
from streamrl.common.weights.relay import Manifest, RelayError, RelayNode, build_manifest, upstreams

CHUNK = 4096
DATA = os.urandom(CHUNK * 10 + 123)


@contextmanager
def nodes(count: int, digest_threads: int = 0) -> Iterator[list[RelayNode]]:
    made = [RelayNode(stall_s=2.0, digest_threads=digest_threads) for _ in range(count)]
    try:
        yield made
    finally:
        for node in made:
            node.close()


def fetch_all(receivers: list[RelayNode], order: list[relay.Address], manifest: Manifest, fanout: int) -> list[bytes]:
    results: list[bytes] = [b""] * len(receivers)

    def run(i: int) -> None:
        results[i] = bytes(
            receivers[i].fetch(manifest.version, manifest.checksum(), upstreams(order, i + 1, fanout), 10.0)
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(receivers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_upstreams_orders_parent_then_ancestors_to_the_source() -> None:
    order = [("h", i) for i in range(8)]
    assert upstreams(order, 5, fanout=1) == [("h", 4), ("h", 3), ("h", 2), ("h", 1), ("h", 0)]
    assert upstreams(order, 5, fanout=2) == [("h", 2), ("h", 0)]
    assert upstreams(order, 5, fanout=8) == [("h", 0)]


@pytest.mark.parametrize(("count", "fanout", "digest_threads"), [(4, 1, 0), (6, 2, 0), (3, 3, 0), (4, 1, 2)])
def test_every_receiver_gets_the_verified_bytes_and_the_source_sends_once_per_child(
    count: int, fanout: int, digest_threads: int
) -> None:
    manifest = build_manifest(7, DATA, CHUNK)
    with nodes(count + 1, digest_threads) as made:
        made[0].hold(manifest, DATA)
        order = [node.address for node in made]
        assert fetch_all(made[1:], order, manifest, fanout) == [DATA] * count
        assert made[0].bytes_sent == len(DATA) * min(fanout, count)


def test_a_wrong_manifest_checksum_is_refused() -> None:
    manifest = build_manifest(1, DATA, CHUNK)
    with nodes(2) as (source, receiver):
        source.hold(manifest, DATA)
        with pytest.raises(RelayError, match="manifest checksum mismatch"):
            receiver.fetch(1, manifest.checksum(key=b"other"), [source.address], 5.0)


@contextmanager
def fake_upstream(manifest: Manifest, data: bytes, chunks: int, then: str) -> Iterator[relay.Address]:
    """Serves ``chunks`` chunks then closes (``close``), sends a corrupt one (``corrupt``) or stalls (``stall``)."""
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            relay._recv_exact(conn, relay._REQUEST.size)
            conn.sendall(
                relay._HEADER.pack(
                    relay._MAGIC, manifest.version, manifest.total_bytes, manifest.chunk_bytes, manifest.num_chunks
                )
            )
            conn.sendall(manifest.digests)
            conn.sendall(data[: chunks * manifest.chunk_bytes])
            if then == "corrupt":
                conn.sendall(bytes(manifest.chunk_bytes))
            elif then == "stall":
                release.wait(10)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield listener.getsockname()[:2]
    finally:
        release.set()
        thread.join()
        listener.close()


@pytest.mark.parametrize("digest_threads", [0, 2])
@pytest.mark.parametrize("then", ["close", "corrupt", "stall"])
def test_a_failing_upstream_is_dropped_and_the_rest_comes_from_an_earlier_holder(
    then: str, digest_threads: int
) -> None:
    manifest = build_manifest(3, DATA, CHUNK)
    with nodes(2, digest_threads) as (source, receiver), fake_upstream(manifest, DATA, 4, then) as dead:
        receiver.stall_s = 0.5
        source.hold(manifest, DATA)
        got = receiver.fetch(3, manifest.checksum(), [dead, source.address], 5.0)
        assert bytes(got) == DATA
        assert source.bytes_sent == len(DATA) - 4 * CHUNK  # resumed at the first missing chunk


def test_a_stalled_upstream_with_no_fallback_is_named_within_the_deadline() -> None:
    manifest = build_manifest(3, DATA, CHUNK)
    with nodes(1) as (receiver,), fake_upstream(manifest, DATA, 2, "stall") as dead:
        started = time.monotonic()
        with pytest.raises(RelayError, match=f"{dead[0]}:{dead[1]}") as error:
            receiver.fetch(3, manifest.checksum(), [dead], 1.0)
        assert time.monotonic() - started < 1.5
        assert "2/11 chunks" in str(error.value)


def test_a_relay_killed_mid_transfer_its_downstream_finishes_from_the_source() -> None:
    manifest = build_manifest(5, DATA, CHUNK)
    with nodes(1) as (source,), nodes(1) as (downstream,), fake_upstream(manifest, DATA, 6, "close") as middle:
        source.hold(manifest, DATA)
        got = downstream.fetch(5, manifest.checksum(), [middle, source.address], 5.0)
        assert bytes(got) == DATA


def test_a_real_relay_closed_mid_transfer_its_downstream_resumes_from_the_source() -> None:
    manifest = build_manifest(9, DATA, CHUNK)
    with nodes(3) as (source, middle, downstream), fake_upstream(manifest, DATA, 6, "stall") as slow:
        source.hold(manifest, DATA)
        middle_errors: list[RelayError] = []

        def middle_fetch() -> None:
            try:
                middle.fetch(9, manifest.checksum(), [slow], 3.0)
            except RelayError as exc:  # its own upstream stalls: expected
                middle_errors.append(exc)

        middle_thread = threading.Thread(target=middle_fetch)
        middle_thread.start()
        got: list[bytes] = []
        downstream_thread = threading.Thread(
            target=lambda: got.append(
                bytes(downstream.fetch(9, manifest.checksum(), [middle.address, source.address], 5.0))
            )
        )
        downstream_thread.start()
        deadline = time.monotonic() + 5.0
        while middle.bytes_sent < 6 * CHUNK and time.monotonic() < deadline:  # downstream holds what middle had
            time.sleep(0.01)
        assert middle.bytes_sent == 6 * CHUNK
        middle.close()
        downstream_thread.join()
        middle_thread.join()
        assert got == [DATA]
        assert source.bytes_sent == len(DATA) - 6 * CHUNK
        assert len(middle_errors) == 1


def test_with_digest_threads_nothing_after_a_corrupt_chunk_counts_as_held() -> None:
    manifest = build_manifest(4, DATA, CHUNK)
    corrupt = bytearray(DATA)
    corrupt[2 * CHUNK] ^= 1  # chunk 2 of 11, then the good rest
    with nodes(1, digest_threads=2) as (receiver,), fake_upstream(manifest, bytes(corrupt), 11, "close") as liar:
        with pytest.raises(RelayError, match="chunk 2 failed its digest"):
            receiver.fetch(4, manifest.checksum(), [liar], 2.0)
        assert receiver._held == 2
