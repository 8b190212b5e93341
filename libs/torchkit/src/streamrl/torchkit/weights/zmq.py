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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from streamrl.common.messages import WeightsPublished, WeightsTransport
from streamrl.common.weights.stream import StreamReceiver
from streamrl.common.weights.wire import DEFAULT_BUCKET_BYTES, BucketServer, WireTensor, encode_version
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
    ) -> None:
        self._server = BucketServer(host, port, advertise_host)
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
            "serving weights version %d: %d tensors, %d bytes in %d buckets (%.3f s) at %s",
            version,
            len(wire),
            encoded.num_bytes,
            len(encoded.buckets),
            time.perf_counter() - start,
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

    @contextmanager
    def receive(
        self, event: WeightsPublished, timeout_s: float, abandoned: threading.Event | None = None
    ) -> Iterator[Received]:
        """The whole verified version (views of the staging buffer, valid inside the context only)."""
        fetched = self._stream.fetch(event.endpoint, event.version, event.checksum, timeout_s, abandoned)
        buckets = sorted(fetched, key=lambda bucket: bucket.bucket)
        yield Received(event.version, [(t.name, to_torch(t)) for b in buckets for t in b.tensors])

    def release_memory(self) -> None:
        """Drop the staging buffer (one model's bytes of host memory) until the next version."""
        self._stream = StreamReceiver()

    def close(self) -> None:
        pass
