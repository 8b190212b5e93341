"""The ``relay`` weight transport through the one protocol pair, on real loopback sockets: a learner and
four workers in a chain (each worker fetching from the one before it while serving the one after it); an
upstream killed mid-transfer (the worker re-sources and completes, or - with nowhere left to go - yields
nothing); a corrupted chunk refused; a stalled upstream dropped for the learner."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import WeightsPublished
from streamrl.common.weights.relay import _REQUEST, Address, RelayNode, upstreams
from streamrl.torchkit.testing import weights_event
from streamrl.torchkit.weights.factory import make_publisher, make_receiver
from streamrl.torchkit.weights.protocol import WeightReceiver
from streamrl.torchkit.weights.relay import RelayPublisher, RelayReceiver, RelaySeat, install_seat, parse_endpoint

CPU = torch.device("cpu")
CHUNK = 64 * 1024
NAMED = [
    ("model.embed_tokens.weight", torch.randn(256, 128).to(torch.bfloat16)),
    ("model.layers.0.mlp.up_proj.weight", torch.randn(512, 128)),
    ("model.norm.weight", torch.randn(128)),
]


@pytest.fixture
def publisher() -> Iterator[RelayPublisher]:
    pub = RelayPublisher(chunk_bytes=CHUNK, tied_aliases={})
    yield pub
    pub.close()


def seat(stall_s: float = 2.0) -> RelaySeat:
    return RelaySeat(RelayNode(stall_s=stall_s))


def tensors_of(receiver: WeightReceiver, event: WeightsPublished, timeout_s: float = 20.0) -> dict[str, torch.Tensor]:
    with receiver.receive(event, timeout_s) as received:
        assert received.version == event.version
        return {name: t.clone() for name, t in received.tensors}


def assert_same(got: dict[str, torch.Tensor]) -> None:
    assert set(got) == {name for name, _ in NAMED}
    for name, tensor in NAMED:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


def fetch_concurrently(
    receivers: list[RelayReceiver], event: WeightsPublished
) -> list[dict[str, torch.Tensor] | BaseException]:
    """Every receiver's tensors (or its error), all fetching at once, the last one asking first."""
    results: list[dict[str, torch.Tensor] | BaseException] = [{} for _ in receivers]

    def run(i: int) -> None:
        try:
            results[i] = tensors_of(receivers[i], event)
        except BaseException as e:  # noqa: BLE001 - the caller asserts on it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in reversed(range(len(receivers)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


class Proxy:
    """A relay upstream in front of a real one that dies after ``cut_after`` bytes, or flips the byte at
    ``flip_at`` (counted from the start of the reply: header, digests, then chunks)."""

    def __init__(self, upstream: Address, cut_after: int | None = None, flip_at: int | None = None) -> None:
        self.upstream, self.cut_after, self.flip_at = upstream, cut_after, flip_at
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address: Address = self.server.getsockname()[:2]
        self.served = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self.served += 1
        try:
            self._forward(conn)
        except OSError:  # the downstream hung up (it refused a chunk): nothing to forward to
            pass

    def _forward(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(self.upstream) as up:
            request = conn.recv(_REQUEST.size, socket.MSG_WAITALL)
            up.sendall(request)
            sent = 0
            while data := up.recv(65536):
                buf = bytearray(data)
                if self.flip_at is not None and sent <= self.flip_at < sent + len(buf):
                    buf[self.flip_at - sent] ^= 0xFF
                if self.cut_after is not None and sent + len(buf) >= self.cut_after:
                    conn.sendall(buf[: self.cut_after - sent])
                    return  # the relay dies: its downstream sees the connection close mid-chunk
                conn.sendall(buf)
                sent += len(buf)

    def close(self) -> None:
        self.server.close()


def test_the_factory_builds_both_ends_of_the_relay() -> None:
    pub = make_publisher("relay")
    try:
        event = weights_event(1, pub.publish(NAMED, 1))
        assert event.transport == "relay" and event.endpoint.startswith("tcp://127.0.0.1:")
        receiver = make_receiver("relay", device=CPU)  # no seat installed: straight from the learner
        try:
            assert receiver.transport == "relay"
            got = tensors_of(receiver, event)
        finally:
            receiver.close()
        assert torch.equal(got["lm_head.weight"], NAMED[0][1])  # the tied head, sent explicitly
    finally:
        pub.close()


def test_an_installed_seat_is_where_a_relay_receiver_fetches_into() -> None:
    mine = seat()
    install_seat(mine)
    try:
        receiver = make_receiver("relay", device=CPU)
        assert isinstance(receiver, RelayReceiver) and receiver.seat is mine
    finally:
        install_seat(None)
        mine.close()


def test_a_chain_of_four_workers_gets_every_version_with_the_learner_sending_it_once(
    publisher: RelayPublisher,
) -> None:
    seats = [seat() for _ in range(4)]
    receivers = [RelayReceiver(s) for s in seats]
    try:
        for version in (1, 2):
            event = weights_event(version, publisher.publish(NAMED, version))
            order = [parse_endpoint(event.endpoint), *(s.node.address for s in seats)]
            for i, s in enumerate(seats, start=1):
                s.plan(version, event.checksum, upstreams(order, i)[:-1])
            results = fetch_concurrently(receivers, event)
            for got in results:
                assert isinstance(got, dict), got
                assert_same(got)
            assert publisher.bytes_sent == version * event.num_bytes  # once per version, whatever the workers
            for s in seats[:-1]:  # each worker served the next one the whole version
                assert s.node.bytes_sent == version * event.num_bytes
            assert seats[-1].node.bytes_sent == 0
    finally:
        for s in seats:
            s.close()


def test_a_relay_killed_mid_transfer_is_replaced_by_the_next_upstream(publisher: RelayPublisher) -> None:
    event = weights_event(1, publisher.publish(NAMED, 1))
    dying = Proxy(parse_endpoint(event.endpoint), cut_after=event.num_bytes // 2)
    mine = seat()
    try:
        mine.plan(1, event.checksum, [dying.address])
        assert_same(tensors_of(RelayReceiver(mine), event))
        assert dying.served == 1
        # re-sourced at the first missing chunk: the learner sent the half the relay did not deliver, once more
        assert publisher.bytes_sent < 2 * event.num_bytes
    finally:
        dying.close()
        mine.close()


def test_a_relay_node_killed_mid_version_leaves_its_downstream_to_resume_from_the_learner(
    publisher: RelayPublisher,
) -> None:
    """learner -> A -> B, A's own fetch cut half-way (and nowhere else for it to go), then A killed: A yields
    nothing, B resumes from the learner at its first missing chunk and completes."""
    event = weights_event(1, publisher.publish(NAMED, 1))
    learner = parse_endpoint(event.endpoint)
    cut = Proxy(learner, cut_after=event.num_bytes // 2)
    a, b = seat(), seat()
    stranded = msgspec.structs.replace(event, endpoint=dead_endpoint())  # A's event: its learner is gone
    a.plan(1, event.checksum, [cut.address])
    b.plan(1, event.checksum, [a.node.address, learner])
    got: list[dict[str, torch.Tensor] | BaseException] = []
    downstream = threading.Thread(target=lambda: got.extend(fetch_concurrently([RelayReceiver(b)], stranded)))
    try:
        downstream.start()
        with pytest.raises(WeightSyncError, match="closed"), RelayReceiver(a).receive(stranded, 10):
            pytest.fail("a half-received version was handed out")
        assert 0 < a.node._held < event.num_buckets
        deadline = time.monotonic() + 10
        while a.node.bytes_sent == 0 and time.monotonic() < deadline:  # B takes the prefix A verified
            time.sleep(0.01)
        assert a.node.bytes_sent > 0
        a.close()  # the relay dies with its downstream mid-version, waiting for A's next chunk
        downstream.join(30)
        assert len(got) == 1 and isinstance(got[0], dict), got
        assert_same(got[0])
        assert publisher.bytes_sent < 2 * event.num_bytes  # B took from the learner only what A had not relayed
    finally:
        cut.close()
        a.close()
        b.close()


def dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("proxy", "error"),
    [
        (lambda up, n: Proxy(up, cut_after=n // 2), "closed"),
        (lambda up, n: Proxy(up, flip_at=n // 2), "failed its digest"),
    ],
    ids=["killed", "corrupted"],
)
def test_nothing_is_yielded_when_no_upstream_completes_the_version(
    publisher: RelayPublisher, proxy: Callable[[Address, int], Proxy], error: str
) -> None:
    event = weights_event(1, publisher.publish(NAMED, 1))
    bad = proxy(parse_endpoint(event.endpoint), event.num_bytes)
    gone = msgspec.structs.replace(event, endpoint=dead_endpoint())  # and the learner is gone too
    mine = seat()
    applied = []
    try:
        mine.plan(1, event.checksum, [bad.address])
        with pytest.raises(WeightSyncError, match=error), RelayReceiver(mine).receive(gone, 10) as received:
            applied.append(received)  # never reached: a half-received version is never handed out
        assert applied == []
        assert 0 < mine.node._held < event.num_buckets  # it holds a verified prefix, serves no more than that
    finally:
        bad.close()
        mine.close()


def test_a_corrupted_chunk_is_refused_and_fetched_again_from_the_next_upstream(publisher: RelayPublisher) -> None:
    event = weights_event(1, publisher.publish(NAMED, 1))
    liar = Proxy(parse_endpoint(event.endpoint), flip_at=event.num_bytes // 2)
    mine = seat()
    try:
        mine.plan(1, event.checksum, [liar.address])
        assert_same(tensors_of(RelayReceiver(mine), event))
    finally:
        liar.close()
        mine.close()


def test_a_stalled_upstream_is_dropped_for_the_learner(publisher: RelayPublisher) -> None:
    event = weights_event(1, publisher.publish(NAMED, 1))
    idle = seat()  # a worker that never fetches this version: it has nothing to serve
    mine = seat(stall_s=0.5)
    try:
        mine.plan(1, event.checksum, [idle.node.address])
        assert_same(tensors_of(RelayReceiver(mine), event, timeout_s=10))
    finally:
        idle.close()
        mine.close()


def test_a_worker_that_holds_the_version_answers_without_fetching(publisher: RelayPublisher) -> None:
    event = weights_event(1, publisher.publish(NAMED, 1))
    mine = seat()
    try:
        receiver = RelayReceiver(mine)
        assert_same(tensors_of(receiver, event))
        forged = msgspec.structs.replace(event, checksum="0" * 64)  # what it holds is not what this event signs
        with pytest.raises(WeightSyncError, match="manifest checksum mismatch"), receiver.receive(forged, 2):
            pass
        publisher.close()  # a learner restart: the worker still has (and relays) what it verified
        assert_same(tensors_of(receiver, event))
    finally:
        mine.close()


def test_an_abandoned_fetch_stops_within_a_poll_even_while_its_upstream_is_silent(publisher: RelayPublisher) -> None:
    event = weights_event(1, publisher.publish(NAMED, 1))
    idle = seat()  # connected to, never answers: the fetch waits for the header
    mine = seat(stall_s=10.0)
    abandoned = threading.Event()
    try:
        mine.plan(1, event.checksum, [idle.node.address])
        threading.Timer(0.3, abandoned.set).start()
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="abandoned"), RelayReceiver(mine).receive(event, 20, abandoned):
            pytest.fail("an abandoned version was handed out")
        assert time.monotonic() - started < 2.0  # not the 10 s stall limit
    finally:
        idle.close()
        mine.close()
