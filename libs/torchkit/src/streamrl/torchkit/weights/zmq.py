"""The ``zmq`` transport (the portable path of docs/design.md section 5): both ends.

:class:`ZmqPublisher` (learner) turns named torch tensors into the buckets of
:mod:`streamrl.common.weights.wire` and serves the latest version from a background thread;
:class:`ZmqReceiver` (an engine) pulls them with a :class:`~streamrl.common.weights.stream.StreamReceiver`
(the manifest checked against the signed event's checksum, then every chunk over several pipelined TCP
connections, each verified as it lands, into one staging buffer the receiver keeps across versions) and,
only once every bucket of the version verified, hands each tensor out as a read-only torch view of the
staging buffer (:func:`streamrl.torchkit.wire.to_torch`): an engine never loads a bucket of a version
that does not arrive whole. Works on CPU, across hosts, for late joiners.

Tensors are copied to host memory once per version (:func:`streamrl.torchkit.wire.to_wire`: bf16
stays bf16 on the wire, half the bytes of fp32). With tied embeddings ``lm_head.weight`` is sent
explicitly (:mod:`.tied`).

Delta sync: the publisher keeps the single-step deltas of the last ``max_behind`` versions (at most a
quarter of the model's bytes in all), and a receiver whose staging buffer holds a verified earlier version
gets only what changed, applied in place and checked against every chunk digest of the new version; a
receiver too far behind, released, new, or whose delta fails gets the full version
(:mod:`streamrl.common.weights.stream`). Either payload: a LoRA adapter's delta is an adapter's tensors.
Each update logs one INFO line saying which it was and how many bytes moved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from streamrl.common.messages import WeightsPublished, WeightsTransport
from streamrl.common.weights.stream import StreamReceiver, SyncInfo
from streamrl.common.weights.wire import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MAX_BEHIND,
    BucketServer,
    WireTensor,
    encode_version,
)
from streamrl.torchkit.weights.protocol import PublishedWeights, Received
from streamrl.torchkit.weights.tied import TIED_ALIASES, tied_copies
from streamrl.torchkit.wire import to_torch, to_wire

logger = logging.getLogger(__name__)


class ZmqPublisher:
    """Buckets and serves the latest weights version; bind ``port=0`` for a free port.

    Example:
        publisher = ZmqPublisher(host="0.0.0.0", port=0, advertise_host="learner-0")
        fields = publisher.publish(model.state_dict().items(), version=3)
        # -> WeightsPublished(version=3, **fields, ...)
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        tied_aliases: Mapping[str, tuple[str, ...]] = TIED_ALIASES,
        max_behind: int = DEFAULT_MAX_BEHIND,
    ) -> None:
        """``max_behind``: versions back a receiver still gets deltas from (0: full weights only); the deltas
        take at most a quarter of the model's bytes, plus one extra copy of the weights while one is encoded."""
        self._server = BucketServer(host, port, advertise_host, max_behind)
        self._bucket_bytes = bucket_bytes
        self._tied_aliases = tied_aliases

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` receivers connect to."""
        return self._server.endpoint

    @property
    def version(self) -> int:
        """Version served now (-1 = none yet)."""
        return self._server.current_version

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishedWeights:
        """Serve ``named_tensors`` as ``version`` (replacing the previous one)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if version <= self._server.current_version:
            raise ValueError(f"version must increase: {version} after {self._server.current_version}")
        start = time.perf_counter()
        wire = [to_wire(name, t) for name, t in named_tensors]
        names = {t.name: t for t in wire}
        for alias, source in tied_copies(names, self._tied_aliases):
            wire.append(WireTensor(alias, names[source].dtype, names[source].array))
        encoded = encode_version(wire, version, self._bucket_bytes)
        self._server.set_current(encoded)
        logger.info(
            "serving weights version %d: %d tensors, %d bytes in %d buckets (%.3f s, deltas kept: %d bytes) at %s",
            version,
            len(wire),
            encoded.num_bytes,
            len(encoded.buckets),
            time.perf_counter() - start,
            self._server.delta_bytes,
            self.endpoint,
        )
        return PublishedWeights(
            transport="zmq",
            checksum=encoded.checksum,
            num_bytes=encoded.num_bytes,
            num_buckets=len(encoded.buckets),
            endpoint=self.endpoint,
            ipc=None,
            broadcast=None,
        )

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.close()


class ZmqReceiver:
    """Pulls each version from the weight server the event names into the staging buffer it keeps."""

    transport: WeightsTransport = "zmq"

    def __init__(self) -> None:
        self._stream = StreamReceiver()

    @property
    def last_sync(self) -> SyncInfo | None:
        """What the last version received moved: delta or full, its bytes (None before the first)."""
        return self._stream.last

    @contextmanager
    def receive(
        self, event: WeightsPublished, timeout_s: float, abandoned: threading.Event | None = None
    ) -> Iterator[Received]:
        """The whole verified version (views of the staging buffer, valid inside the context only)."""
        fetched = self._stream.fetch(event.endpoint, event.version, event.checksum, timeout_s, abandoned)
        buckets = sorted(fetched, key=lambda bucket: bucket.bucket)
        _log_sync(self._stream.last, event)
        yield Received(event.version, [(t.name, to_torch(t)) for b in buckets for t in b.tensors])

    def release_memory(self) -> None:
        """Drop the staging buffer (one model's bytes of host memory) until the next version, which is then
        fetched whole."""
        self._stream.release()

    def close(self) -> None:
        pass


def _log_sync(info: SyncInfo | None, event: WeightsPublished) -> None:
    """One INFO line per version: delta or full, bytes moved."""
    if info is None or info.version != event.version:
        return
    if info.kind == "delta":
        logger.info(
            "weights version %d (%s): delta from version %d, %d bytes received (full: %d, %.1fx fewer)",
            info.version,
            event.payload,
            info.base_version,
            info.num_bytes,
            info.full_bytes,
            info.full_bytes / max(info.num_bytes, 1),
        )
    else:
        logger.info(
            "weights version %d (%s): full, %d bytes received (%s)",
            info.version,
            event.payload,
            info.num_bytes,
            info.reason,
        )
