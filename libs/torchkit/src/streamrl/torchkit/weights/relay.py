"""The ``relay`` transport: workers that hold a version serve it onward (issue 39 item 4), both ends.

:class:`RelayPublisher` (learner) lays each version out as one flat buffer - a msgpack table of
:class:`~streamrl.common.weights.wire.TensorEntry` then the tensors' bytes, 64-byte aligned - and holds
it in a :class:`~streamrl.common.weights.relay.RelayNode`: the root of the relay. The event's checksum is
the relay manifest's (every chunk's blake2b digest, version and sizes), so the signed event binds every
byte, the tensor table included.

:class:`RelayReceiver` (an engine) fetches the version into its :class:`RelaySeat`'s node from the
upstreams the seat names for it (a chain by default: the worker before it in the registry's order, that
one's upstream, ..., finally the learner), forwarding each verified chunk downstream as it lands; a dead,
stalled or lying upstream is dropped and the next one resumes at the first missing chunk. Only once every
chunk verified are the tensors handed out (read-only torch views of the node's buffer), so a killed relay
never leaves a half-applied version.

Who holds what is the rollout service's business (it reads the heartbeats in Redis): it builds the seat,
advertises the seat's address in its heartbeat and, before each update, tells the seat the upstreams of
that version (:meth:`RelaySeat.plan`). Receivers never touch Redis. The seat reaches the receiver the
engine builds through :func:`install_seat` (one per process: the worker's node). A receiver in a process
without a seat (a vLLM worker process) fetches from the learner alone and serves nobody.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import WeightsPublished, WeightsTransport
from streamrl.common.weights.relay import (
    Address,
    RelayAbandonedError,
    RelayError,
    RelayNode,
    build_manifest,
)
from streamrl.common.weights.wire import ALIGN_BYTES, BF16, ReceivedTensor, TensorEntry, WireTensor
from streamrl.torchkit.weights.protocol import PublishedWeights, Received
from streamrl.torchkit.weights.tied import TIED_ALIASES, tied_copies
from streamrl.torchkit.wire import to_torch, to_wire

logger = logging.getLogger(__name__)

RELAY_CHUNK_BYTES = 4 * 2**20
"""Relay chunk size: a downstream starts forwarding after one chunk, so the time to the last of N workers is
about the model's transfer time plus N chunk times (docs/scaling.md)."""
RELAY_STALL_S = 5.0
"""An upstream that sends nothing for this long is dropped (the next one resumes)."""
_TABLE_LENGTH = struct.Struct("<Q")
_table_encoder = msgspec.msgpack.Encoder()
_table_decoder = msgspec.msgpack.Decoder(list[TensorEntry])


def parse_endpoint(endpoint: str) -> Address:
    """``tcp://host:port`` (or ``host:port``) as an address."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise WeightSyncError(f"relay endpoint {endpoint!r} is not host:port")
    return host, int(port)


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def pack_version(tensors: list[WireTensor]) -> memoryview:
    """One flat buffer: table length, msgpack table, then each tensor at its (aligned) offset."""
    entries: list[TensorEntry] = []
    offset = 0
    for t in tensors:
        offset = _aligned(offset)
        entries.append(TensorEntry(t.name, t.dtype, list(t.array.shape), offset, t.array.nbytes))
        offset += t.array.nbytes
    table = _table_encoder.encode(entries)
    start = _aligned(_TABLE_LENGTH.size + len(table))
    buffer = bytearray(start + offset)
    _TABLE_LENGTH.pack_into(buffer, 0, len(table))
    buffer[_TABLE_LENGTH.size : _TABLE_LENGTH.size + len(table)] = table
    flat = np.frombuffer(buffer, dtype=np.uint8)
    for t, e in zip(tensors, entries, strict=True):
        flat[start + e.offset : start + e.offset + e.nbytes] = np.ascontiguousarray(t.array).reshape(-1).view(np.uint8)
    return memoryview(buffer)


def unpack_version(buffer: memoryview) -> list[ReceivedTensor]:
    """Read-only arrays over a verified flat buffer (no copy); a malformed table is a WeightSyncError."""
    try:
        (length,) = _TABLE_LENGTH.unpack_from(buffer, 0)
        entries = _table_decoder.decode(buffer[_TABLE_LENGTH.size : _TABLE_LENGTH.size + length])
    except (struct.error, msgspec.DecodeError) as e:
        raise WeightSyncError(f"relay payload: unreadable tensor table ({e})") from e
    start = _aligned(_TABLE_LENGTH.size + length)
    data = buffer[start:].toreadonly()
    out = []
    for entry in entries:
        if entry.offset + entry.nbytes > len(data):
            raise WeightSyncError(f"relay payload: tensor {entry.name} lies past the end of the buffer")
        dtype = np.dtype(np.uint16) if entry.dtype == BF16 else np.dtype(entry.dtype)
        array = np.frombuffer(data, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=entry.offset)
        out.append(ReceivedTensor(entry.name, entry.dtype, array.reshape(entry.shape)))
    return out


class RelayPublisher:
    """The relay's root: serves the latest version from the learner (``weights_host``/``weights_port``).

    Example:
        publisher = RelayPublisher(host="0.0.0.0", port=29600, advertise_host="learner-0")
        fields = publisher.publish(model.state_dict().items(), version=3)  # -> WeightsPublished(**fields, ...)
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        chunk_bytes: int = RELAY_CHUNK_BYTES,
        tied_aliases: Mapping[str, tuple[str, ...]] = TIED_ALIASES,
        stall_s: float = RELAY_STALL_S,
    ) -> None:
        self._node = RelayNode(host, port, stall_s=stall_s)
        advertised = advertise_host or (host if host not in ("0.0.0.0", "*", "") else socket.gethostname())
        self.endpoint = f"tcp://{advertised}:{self._node.address[1]}"
        self._chunk_bytes = chunk_bytes
        self._tied_aliases = tied_aliases
        self.version = -1

    @property
    def bytes_sent(self) -> int:
        """Bytes the learner sent to workers so far (~1x the model per version on a chain)."""
        return self._node.bytes_sent

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishedWeights:
        """Hold ``named_tensors`` as ``version`` (replacing the previous one) at the relay's root."""
        if version < 0 or version <= self.version:
            raise ValueError(f"version must increase and be >= 0: {version} after {self.version}")
        start = time.perf_counter()
        wire = [to_wire(name, t) for name, t in named_tensors]
        names = {t.name: t for t in wire}
        if len(names) != len(wire) or not wire:
            raise ValueError("a weights version needs at least one tensor, with unique names")
        for alias, source in tied_copies(names, self._tied_aliases):
            wire.append(WireTensor(alias, names[source].dtype, names[source].array))
        buffer = pack_version(wire)
        manifest = build_manifest(version, buffer, self._chunk_bytes)
        self._node.hold(manifest, buffer)
        self.version = version
        logger.info(
            "relaying weights version %d: %d tensors, %d bytes in %d chunks (%.3f s) from %s",
            version,
            len(wire),
            manifest.total_bytes,
            manifest.num_chunks,
            time.perf_counter() - start,
            self.endpoint,
        )
        return PublishedWeights(
            transport="relay",
            checksum=manifest.checksum(),
            num_bytes=manifest.total_bytes,
            num_buckets=manifest.num_chunks,
            endpoint=self.endpoint,
            ipc=None,
            broadcast=None,
        )

    def close(self) -> None:
        """Stop serving: workers mid-fetch re-source (from peers that hold the version) or retry."""
        self._node.close()


@dataclass
class RelaySeat:
    """A worker's place in the relay: its node (which serves what it holds onward) and, per version, the
    upstreams to fetch it from, nearest first (set by the rollout service from the registry)."""

    node: RelayNode
    advertise_host: str = "127.0.0.1"
    _plans: dict[tuple[int, str], list[Address]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        """``host:port`` other workers reach this node at (the heartbeat's ``weights_relay``)."""
        return f"{self.advertise_host}:{self.node.address[1]}"

    def plan(self, version: int, checksum: str, upstreams: list[Address]) -> None:
        """Fetch this version from ``upstreams`` (peers, nearest first; the learner is added last)."""
        with self._lock:
            self._plans = {(version, checksum): list(upstreams)}

    def upstreams(self, event: WeightsPublished) -> list[Address]:
        """Where to fetch ``event``'s version: the planned peers, then the learner."""
        with self._lock:
            peers = self._plans.get((event.version, event.checksum), [])
        learner = parse_endpoint(event.endpoint)
        return [a for a in peers if a != learner and a != self.node.address] + [learner]

    def close(self) -> None:
        self.node.close()


_installed: RelaySeat | None = None
_installed_lock = threading.Lock()


def install_seat(seat: RelaySeat | None) -> None:
    """Make ``seat`` this process's relay seat: relay receivers built from now on fetch into it."""
    global _installed
    with _installed_lock:
        _installed = seat


def installed_seat() -> RelaySeat | None:
    with _installed_lock:
        return _installed


class RelayReceiver:
    """Fetches each version into its seat's node (verified chunk by chunk, served onward meanwhile)."""

    transport: WeightsTransport = "relay"

    def __init__(self, seat: RelaySeat | None = None, stall_s: float = RELAY_STALL_S) -> None:
        self._own = seat is None
        self.seat = seat if seat is not None else RelaySeat(RelayNode("127.0.0.1", 0, stall_s=stall_s))

    @contextmanager
    def receive(
        self, event: WeightsPublished, timeout_s: float, abandoned: threading.Event | None = None
    ) -> Iterator[Received]:
        """The whole verified version (views of the node's buffer, valid inside the context only)."""
        sources = self.seat.upstreams(event)
        try:
            buffer = self.seat.node.fetch(event.version, event.checksum, sources, timeout_s, abandoned=abandoned)
        except RelayAbandonedError as e:
            raise WeightSyncError(f"weights version {event.version}: fetch abandoned ({e})") from e
        except RelayError as e:
            raise WeightSyncError(f"relay: {e}") from e
        tensors = unpack_version(buffer)
        yield Received(event.version, [(t.name, to_torch(t)) for t in tensors])

    def release_memory(self) -> None:
        """Nothing to drop: the node keeps the version it holds, to serve it onward."""

    def close(self) -> None:
        if self._own:
            self.seat.close()
