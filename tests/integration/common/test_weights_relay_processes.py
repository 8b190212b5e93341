"""The weights relay across real processes: a relay process SIGKILLed mid-transfer, and its
downstream finishes from the source at its first missing chunk, with every byte verified."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection

from streamrl.common.weights import relay
from streamrl.common.weights.relay import Manifest, RelayError, RelayNode, build_manifest

CHUNK = 64 << 10
DATA = os.urandom(CHUNK * 16)
HELD_BY_MIDDLE = 6


def _middle(conn: Connection, checksum: str, upstream: relay.Address) -> None:
    node = RelayNode(stall_s=30.0)
    conn.send(node.address)
    try:
        node.fetch(1, checksum, [upstream], deadline_s=60.0)
    except RelayError:
        pass
    time.sleep(60)  # killed before this ends


def _stalling_upstream(manifest: Manifest, listener: socket.socket, release: threading.Event) -> None:
    conn, _ = listener.accept()
    with conn:
        relay._recv_exact(conn, relay._REQUEST.size)
        header = relay._HEADER.pack(
            relay._MAGIC, manifest.version, manifest.total_bytes, manifest.chunk_bytes, manifest.num_chunks
        )
        conn.sendall(header + manifest.digests + DATA[: HELD_BY_MIDDLE * CHUNK])
        release.wait(30)


def test_a_relay_process_killed_mid_transfer_its_downstream_finishes_from_the_source() -> None:
    manifest = build_manifest(1, DATA, CHUNK)
    source, downstream = RelayNode(stall_s=5.0), RelayNode(stall_s=5.0)
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()
    feeder = threading.Thread(target=_stalling_upstream, args=(manifest, listener, release))
    feeder.start()
    parent, child = mp.get_context("fork").Pipe()
    middle = mp.get_context("fork").Process(
        target=_middle, args=(child, manifest.checksum(), listener.getsockname()[:2]), daemon=True
    )
    middle.start()
    try:
        source.hold(manifest, DATA)
        middle_address = parent.recv()
        got: list[bytes] = []
        fetch = threading.Thread(
            target=lambda: got.append(
                bytes(downstream.fetch(1, manifest.checksum(), [middle_address, source.address], 20.0))
            )
        )
        fetch.start()
        deadline = time.monotonic() + 10.0
        while downstream._held < HELD_BY_MIDDLE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert downstream._held == HELD_BY_MIDDLE
        killed_at = time.monotonic()
        assert middle.pid is not None
        os.kill(middle.pid, signal.SIGKILL)
        fetch.join(20)
        assert got == [DATA]
        assert time.monotonic() - killed_at < 5.0
        assert source.bytes_sent == len(DATA) - HELD_BY_MIDDLE * CHUNK
    finally:
        release.set()
        middle.join(5)
        feeder.join(5)
        listener.close()
        parent.close()
        child.close()
        source.close()
        downstream.close()
