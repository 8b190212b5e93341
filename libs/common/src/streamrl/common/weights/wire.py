"""Wire protocol of the portable weight path (docs/design.md section 5): learner -> rollout over ZMQ.

The learner serves the weights of one version as a list of **buckets**. A bucket is one flat
byte buffer holding many tensors back to back (each aligned to ``ALIGN_BYTES``) plus a msgpack
header that says where each tensor lies::

    BucketHeader {type: "bucket", version, index, num_buckets, num_bytes, chunk_bytes,
                  tensors: [{name, dtype, shape, offset, nbytes}, ...]}   frame 1 (msgpack)
    raw bytes                                                              frame 2

Receivers **pull**: a ZMQ DEALER sends ``BucketRequest {type: "get", version, index}`` to the
server's ROUTER and gets ``[header, data]`` back, or one ``ErrorReply {type: "error", message,
current_version}`` frame when the version is not the one served (a stale or future version).
Pulling lets a worker that joins late fetch the current version at its own pace, and keeps the
server stateless per receiver.

Two ways to receive a version, both from the one server and the one endpoint:

* :func:`fetch_buckets` pulls whole buckets over that ZMQ socket and verifies the checksum before it
  yields a single tensor, so a failed sync never leaves a receiver half-updated;
* :mod:`streamrl.common.weights.stream` asks the ZMQ socket for the version's :class:`Manifest`
  (every bucket header and chunk digest), then pulls the data in chunks over several raw TCP
  connections (:mod:`streamrl.common.weights.chunks`) into one preallocated buffer and hands out each
  bucket once all its chunks verified, while later ones are still in flight (the fast path).

A receiver whose staging buffer holds a verified earlier version may instead ask, after the manifest,
for ``DeltaRequest {type: "delta_get", version, base_version, base_checksum}``: the server answers
``DeltaReply {type: "delta", version, base_version, links, num_bytes}`` and one frame per link of the
chain it keeps (:class:`~streamrl.common.weights.delta.DeltaHistory`, :func:`delta_link`), or ``NoDelta
{type: "no_delta", version, reason}``. Every request and manifest carries ``protocol``
(:data:`WIRE_PROTOCOL`, 2; absent = 1, before delta sync): either side refuses the other protocol by name.

Checksum (hex, 32 bytes): blake2b, personalised ``streamrl-wire-v2``, over the version and, per
bucket in order, its header frame, its data length and the blake3 digests of its data's
``chunk_bytes`` chunks (:func:`version_checksum`). It travels in the ``WeightsPublished`` message, so
the one signed checksum authenticates every chunk: a receiver that checked the manifest against it
can verify each chunk alone as it lands. blake3 hashes ~5 GB/s on one core (blake2b ~1 GB/s).

dtypes are numpy names plus ``bfloat16`` (raw little-endian 2-byte words; numpy has no bf16, so
the receiver gets a ``uint16`` array and the dtype name, see :class:`ReceivedTensor`).

Everything here is plain msgpack + bytes (readable from any language); no torch.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import blake3
import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from streamrl.common.errors import WeightSyncError
from streamrl.common.weights.delta import DeltaHistory, Link, TensorSpan, encode_version_delta, word_width

logger = logging.getLogger(__name__)

ALIGN_BYTES = 64
"""Every tensor starts at a multiple of this offset inside its bucket (aligned numpy views)."""
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
"""Target bucket size; a tensor larger than this gets a bucket of its own."""
PIPELINE_DEPTH = 2
"""Bucket requests a receiver keeps in flight (hides the round trip behind the transfer)."""
CONNECT_TIMEOUT_S = 5.0
"""How long a receiver waits for the weight server to answer its connection (the ZMQ handshake, which the
server's I/O thread answers in milliseconds however busy it is) before the fetch fails (s): a server that died -
a learner killed right after it published - fails the sync in seconds, not at ``rollout.weight_sync_timeout_s``."""
CHUNK_BYTES = 1024 * 1024
"""Digest granularity: each bucket's data is hashed (and streamed) in chunks of this many bytes
(1 MiB streamed ~15% faster than 4 MiB and ~35% than 16 MiB on the CPU bench machine; 512 KiB-2 MiB alike)."""
DIGEST_BYTES = 32
"""blake3 digest size of one chunk."""
ABANDON_POLL_S = 0.1
"""How often a waiting receiver looks at its abandon flag (s)."""
BF16 = "bfloat16"
WIRE_PROTOCOL = 2
"""Version of the request/reply protocol on the server's ZMQ socket. 1 (the field absent): before delta
sync; 2: requests and manifests carry ``protocol``, and ``delta_get`` exists. A server refuses a request
of another protocol, and a receiver a manifest of another, each naming both."""
DEFAULT_MAX_BEHIND = 4
"""Single-step deltas a weight server keeps (a receiver at most this many versions behind gets deltas)."""
MAX_DELTA_FRACTION = 0.25
"""A chain of deltas is kept and served only while its bytes stay below this fraction of the full
version's: above it the full weights cost little more to move and nothing to apply."""


class TensorEntry(msgspec.Struct, frozen=True):
    """Where one tensor lies in its bucket."""

    name: str
    dtype: str
    """numpy dtype name or ``bfloat16``."""
    shape: list[int]
    offset: int
    """Byte offset inside the bucket data frame."""
    nbytes: int


class BucketRequest(msgspec.Struct, tag="get", tag_field="type", frozen=True):
    """Receiver -> server: send me bucket ``index`` of ``version``."""

    version: int
    index: int
    protocol: int = 1
    """:data:`WIRE_PROTOCOL` of the receiver (1 when absent: a receiver from before delta sync)."""


class BucketHeader(msgspec.Struct, tag="bucket", tag_field="type", frozen=True):
    """Server -> receiver, first frame of a bucket reply; the second frame is the data."""

    version: int
    index: int
    num_buckets: int
    num_bytes: int
    """Total payload bytes of the whole version (all buckets)."""
    tensors: list[TensorEntry]
    chunk_bytes: int = CHUNK_BYTES
    """Digest granularity of the version (see :func:`version_checksum`)."""


class ErrorReply(msgspec.Struct, tag="error", tag_field="type", frozen=True):
    """Server -> receiver when a request cannot be served (wrong version, bad index)."""

    message: str
    current_version: int
    """Version the server serves now (-1 = nothing published yet)."""


class ManifestRequest(msgspec.Struct, tag="manifest_get", tag_field="type", frozen=True):
    """Receiver -> server: send me the manifest of ``version`` (the streaming receiver's first request)."""

    version: int
    protocol: int = 1
    """:data:`WIRE_PROTOCOL` of the receiver (1 when absent: a receiver from before delta sync)."""


class Manifest(msgspec.Struct, tag="manifest", tag_field="type", frozen=True):
    """Server -> receiver: what a streaming receiver needs before the data; checked against the checksum."""

    version: int
    num_bytes: int
    stream_port: int
    """Port of the raw TCP chunk server on the endpoint's host (0 = this server does not stream)."""
    headers: list[bytes]
    """Each bucket's header frame, exactly as hashed."""
    bucket_bytes: list[int]
    """Length of each bucket's data."""
    digests: list[list[bytes]]
    """Per bucket, the blake3 digest of each ``chunk_bytes`` chunk of its data."""
    protocol: int = 1
    """:data:`WIRE_PROTOCOL` of the server."""


class DeltaRequest(msgspec.Struct, tag="delta_get", tag_field="type", frozen=True):
    """Receiver -> server: I hold ``base_version`` (checksum ``base_checksum``, verified); send me what
    turns it into ``version``."""

    version: int
    base_version: int
    base_checksum: str
    protocol: int = 1


class DeltaReply(msgspec.Struct, tag="delta", tag_field="type", frozen=True):
    """Server -> receiver: ``links`` frames follow, each one link of the chain from ``base_version`` to
    ``version`` in order (:func:`streamrl.common.weights.delta.encode_version_delta`), ``num_bytes`` in all."""

    version: int
    base_version: int
    links: int
    num_bytes: int


class NoDelta(msgspec.Struct, tag="no_delta", tag_field="type", frozen=True):
    """Server -> receiver: no delta from the held version (``reason``): fetch the full version."""

    version: int
    reason: str


Reply = BucketHeader | ErrorReply | Manifest | DeltaReply | NoDelta
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(BucketRequest | ManifestRequest | DeltaRequest)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_header_decoder = msgspec.msgpack.Decoder(BucketHeader)


class WireTensor(NamedTuple):
    """A tensor to publish, already on the host as raw bytes: ``array`` is C-contiguous.

    For bf16, ``array`` holds the raw ``uint16`` words and ``dtype`` is ``"bfloat16"``.
    """

    name: str
    dtype: str
    array: np.ndarray


class ReceivedTensor(NamedTuple):
    """A tensor received: name, wire dtype name, and a read-only array over the received bytes."""

    name: str
    dtype: str
    array: np.ndarray


class Bucket(NamedTuple):
    """One encoded bucket: the header frame and the data frame as they go on the wire."""

    header: bytes
    data: bytearray


class EncodedVersion(NamedTuple):
    """All buckets of one version with the checksum that covers them."""

    version: int
    buckets: list[Bucket]
    checksum: str
    num_bytes: int
    digests: list[list[bytes]]
    """Per bucket, the blake3 digests of its data's chunks."""
    chunk_bytes: int
    """Chunk size of those digests."""


def chunk_digests(data: memoryview | bytes | bytearray, chunk_bytes: int) -> list[bytes]:
    """blake3 digest of each ``chunk_bytes`` slice of ``data`` (one digest for empty data)."""
    view = memoryview(data).cast("B")
    starts = range(0, max(len(view), 1), chunk_bytes)
    return [blake3.blake3(view[start : start + chunk_bytes]).digest() for start in starts]


def version_checksum(version: int, headers: list[bytes], bucket_bytes: list[int], digests: list[list[bytes]]) -> str:
    """The version's checksum over its bucket headers, data lengths and chunk digests (module docstring)."""
    digest = hashlib.blake2b(digest_size=32, person=b"streamrl-wire-v2")
    digest.update(_LENGTHS.pack(version, len(headers), 0))
    for header, size, chunks in zip(headers, bucket_bytes, digests, strict=True):
        digest.update(_LENGTHS.pack(len(header), size, len(chunks)))
        digest.update(header)
        digest.update(b"".join(chunks))
    return digest.hexdigest()


_LENGTHS = struct.Struct("<qqq")


def _aligned(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _plan_buckets(tensors: list[WireTensor], bucket_bytes: int) -> list[list[WireTensor]]:
    """Greedy split in order: a bucket takes tensors until the next would overflow ``bucket_bytes``."""
    groups: list[list[WireTensor]] = []
    current: list[WireTensor] = []
    size = 0
    for t in tensors:
        end = _aligned(size) + t.array.nbytes
        if current and end > bucket_bytes:
            groups.append(current)
            current, end = [], t.array.nbytes
        current.append(t)
        size = end
    if current:
        groups.append(current)
    return groups


def encode_version(
    tensors: Iterable[WireTensor],
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> EncodedVersion:
    """Pack named host arrays into buckets and compute the checksum of the whole version."""
    if bucket_bytes < ALIGN_BYTES:
        raise ValueError(f"bucket_bytes must be >= {ALIGN_BYTES}, got {bucket_bytes}")
    if chunk_bytes < ALIGN_BYTES:
        raise ValueError(f"chunk_bytes must be >= {ALIGN_BYTES}, got {chunk_bytes}")
    items = list(tensors)
    if not items:
        raise ValueError("a weights version needs at least one tensor")
    names = [t.name for t in items]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique within a version")
    groups = _plan_buckets(items, bucket_bytes)
    num_bytes = sum(t.array.nbytes for t in items)
    buckets: list[Bucket] = []
    digests: list[list[bytes]] = []
    for index, group in enumerate(groups):
        entries: list[TensorEntry] = []
        offset = 0
        for t in group:
            offset = _aligned(offset)
            entries.append(TensorEntry(t.name, t.dtype, list(t.array.shape), offset, t.array.nbytes))
            offset += t.array.nbytes
        data = bytearray(offset)
        data_u8 = np.frombuffer(data, dtype=np.uint8)
        for t, entry in zip(group, entries, strict=True):
            data_u8[entry.offset : entry.offset + entry.nbytes] = (
                np.ascontiguousarray(t.array).reshape(-1).view(np.uint8)
            )
        header = _encoder.encode(BucketHeader(version, index, len(groups), num_bytes, entries, chunk_bytes))
        buckets.append(Bucket(header, data))
        digests.append(chunk_digests(data, chunk_bytes))
    headers = [b.header for b in buckets]
    checksum = version_checksum(version, headers, [len(b.data) for b in buckets], digests)
    return EncodedVersion(version, buckets, checksum, num_bytes, digests, chunk_bytes)


def decode_bucket(header: BucketHeader, data: memoryview | bytes) -> list[ReceivedTensor]:
    """Read-only arrays over a received data frame (no copy)."""
    out = []
    for e in header.tensors:
        if e.offset + e.nbytes > len(data):
            raise WeightSyncError(f"bucket {header.index}: tensor {e.name} lies past the end of the data frame")
        np_dtype = np.dtype(np.uint16) if e.dtype == BF16 else np.dtype(e.dtype)
        array = np.frombuffer(data, dtype=np_dtype, count=e.nbytes // np_dtype.itemsize, offset=e.offset)
        out.append(ReceivedTensor(e.name, e.dtype, array.reshape(e.shape)))
    return out


def serve_request(
    request_frame: bytes, current: EncodedVersion | None, stream_port: int = 0, deltas: DeltaHistory | None = None
) -> list[bytes | bytearray]:
    """Answer one request frame with the reply frames (pure: the server loop only moves bytes);
    ``stream_port`` is the chunk server's port, named in a manifest; ``deltas`` the links it serves. No
    frames: a delta request whose link is still being encoded, to be answered again once it is."""
    current_version = -1 if current is None else current.version
    try:
        request = _request_decoder.decode(request_frame)
    except msgspec.DecodeError as e:
        return [_encoder.encode(ErrorReply(f"undecodable request: {e}", current_version))]
    if request.protocol != WIRE_PROTOCOL:
        message = (
            f"this weight server speaks wire protocol {WIRE_PROTOCOL}, the receiver protocol {request.protocol}: "
            "run the same streamrl release on the learner and the rollout workers"
        )
        return [_encoder.encode(ErrorReply(message, current_version))]
    if current is None or request.version != current.version:
        message = f"version {request.version} is not served (current version: {current_version})"
        return [_encoder.encode(ErrorReply(message, current_version))]
    if isinstance(request, ManifestRequest):
        return [_encoder.encode(manifest_of(current, stream_port))]
    if isinstance(request, DeltaRequest):
        if deltas is not None and deltas.encoding == request.version:
            return []  # its link is being encoded: the server answers once it is
        chain = (
            "this server keeps no deltas"
            if deltas is None
            else deltas.chain(request.base_version, request.base_checksum, request.version)
        )
        if isinstance(chain, str):
            return [_encoder.encode(NoDelta(request.version, chain))]
        total = sum(len(link.data) for link in chain)
        frames: list[bytes | bytearray] = [
            _encoder.encode(DeltaReply(request.version, request.base_version, len(chain), total))
        ]
        return frames + [link.data for link in chain]
    if not 0 <= request.index < len(current.buckets):
        message = f"bucket {request.index} out of range (version {current.version} has {len(current.buckets)})"
        return [_encoder.encode(ErrorReply(message, current_version))]
    bucket = current.buckets[request.index]
    return [bucket.header, bucket.data]


def manifest_of(encoded: EncodedVersion, stream_port: int) -> Manifest:
    """The manifest a streaming receiver gets for ``encoded``."""
    headers = [b.header for b in encoded.buckets]
    sizes = [len(b.data) for b in encoded.buckets]
    return Manifest(encoded.version, encoded.num_bytes, stream_port, headers, sizes, encoded.digests, WIRE_PROTOCOL)


Layout = list[tuple[list[TensorEntry], int, int]]


def layout_of(headers: Iterable[bytes | BucketHeader], bucket_bytes: Iterable[int]) -> Layout:
    """What a delta needs the same in two versions: every bucket's tensors, data length and chunk size."""
    decoded = (h if isinstance(h, BucketHeader) else _header_decoder.decode(h) for h in headers)
    return [(h.tensors, h.chunk_bytes, size) for h, size in zip(decoded, bucket_bytes, strict=True)]


def delta_link(old: EncodedVersion, new: EncodedVersion) -> Link | None:
    """The link from ``old`` to ``new``, or None when their layouts differ (no delta between them)."""
    sizes = [len(b.data) for b in new.buckets]
    layout = layout_of([b.header for b in new.buckets], sizes)
    if layout != layout_of([b.header for b in old.buckets], [len(b.data) for b in old.buckets]):
        return None
    spans = [
        TensorSpan(bucket, e.offset, e.nbytes, word_width(e.dtype))
        for bucket, (tensors, _, _) in enumerate(layout)
        for e in tensors
    ]
    data = encode_version_delta(
        old.version, new.version, spans, [b.data for b in old.buckets], [b.data for b in new.buckets]
    )
    return Link(old.version, old.checksum, new.version, data)


class BucketServer:
    """Serves the latest :class:`EncodedVersion` on a ZMQ ROUTER socket from a background thread, and
    its chunks on a raw TCP :class:`~streamrl.common.weights.chunks.ChunkServer` (a free port on the
    same host, named in the manifest) for streaming receivers.

    ``endpoint`` is what receivers connect to (``tcp://host:port``). Binding ``tcp://*:0``
    (``port=0``) picks a free port. Only the latest version is kept: requests for any other
    version get an :class:`ErrorReply` naming the current one.

    Delta sync: at each :meth:`set_current` whose layout equals the previous version's, the server encodes
    the link from that version (:func:`delta_link`, while both are still held: the one extra full copy, only
    during the call) and keeps the chain of the last ``max_behind`` links, at most ``max_delta_fraction`` of the
    model's bytes in all (:class:`~streamrl.common.weights.delta.DeltaHistory`); ``max_behind=0`` keeps none.
    """

    POLL_MS = 100
    WAIT_POLL_MS = 5
    """Poll interval while delta requests wait for their link."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        max_behind: int = DEFAULT_MAX_BEHIND,
        max_delta_fraction: float = MAX_DELTA_FRACTION,
    ) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        bind_host = "*" if host in ("0.0.0.0", "*") else host
        fixed_port = port != 0
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        else:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        self.port = port
        self.endpoint = f"tcp://{advertise_host or (socket.gethostname() if bind_host == '*' else host)}:{port}"
        self._current: EncodedVersion | None = None
        self._deltas = DeltaHistory(max_behind, max_delta_fraction)
        self._encoder: threading.Thread | None = None
        self.link_seconds = 0.0
        """How long the last link took to encode (s)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        from streamrl.common.weights.chunks import ChunkServer  # (it imports this module)

        # a fixed port next to a fixed one (firewalls, proxies and port maps open both); a free one otherwise
        stream_port = port + 1 if fixed_port else 0
        try:
            self._chunks = ChunkServer(bind_host, self._get_current, stream_port)
        except OSError as e:
            self._sock.close()
            self._ctx.term()
            raise OSError(
                f"the weight server's chunk stream cannot listen on {host}:{stream_port} (the port after the weight "
                f"server's {port}; keep both free): {e}"
            ) from e
        self._thread = threading.Thread(target=self._serve, name="weights-server", daemon=True)
        self._thread.start()

    def _get_current(self) -> EncodedVersion | None:
        with self._lock:
            return self._current

    @property
    def stream_port(self) -> int:
        """Port of the raw TCP chunk server (same host as :attr:`endpoint`)."""
        return self._chunks.port

    def set_current(self, encoded: EncodedVersion) -> None:
        """Serve ``encoded`` from now on. The link from the previous version is encoded on a background
        thread (the publish does not wait for it; delta requests for ``encoded`` wait instead), which
        holds the previous version until it is done; a publish that comes before it is done waits for it
        (at most one extra copy of the weights)."""
        if self._encoder is not None:
            self._encoder.join()
        with self._lock:
            previous, self._current = self._current, encoded
            if previous is None or self._deltas.max_behind == 0:
                self._deltas.add(None, encoded.num_bytes)
                return
            self._deltas.encoding = encoded.version
        self._encoder = threading.Thread(
            target=self._encode_link, args=(previous, encoded), name="weights-delta", daemon=True
        )
        self._encoder.start()

    def _encode_link(self, previous: EncodedVersion, encoded: EncodedVersion) -> None:
        start = time.perf_counter()
        link = delta_link(previous, encoded)
        del previous
        with self._lock:
            self._deltas.encoding = None
            self._deltas.add(link, encoded.num_bytes)
            kept = self._deltas.num_bytes
        self.link_seconds = time.perf_counter() - start
        logger.debug(
            "delta to version %d: %s in %.3f s (%d bytes kept)",
            encoded.version,
            "none (new layout)" if link is None else f"{len(link.data)} bytes",
            self.link_seconds,
            kept,
        )

    def wait_deltas(self) -> None:
        """Return once the link to the current version is encoded (tests, benchmarks)."""
        if self._encoder is not None:
            self._encoder.join()

    @property
    def delta_bytes(self) -> int:
        """Bytes the kept deltas take (besides the current version's)."""
        with self._lock:
            return self._deltas.num_bytes

    @property
    def current_version(self) -> int:
        with self._lock:
            return -1 if self._current is None else self._current.version

    def _serve(self) -> None:
        waiting: list[tuple[bytes, bytes]] = []  # delta requests for the link being encoded
        while not self._stop.is_set():
            if waiting and self._deltas.encoding is None:
                ready, waiting = waiting, []
                for identity, request in ready:
                    self._answer(identity, request, waiting)
            if not self._sock.poll(self.WAIT_POLL_MS if waiting else self.POLL_MS, zmq.POLLIN):
                continue
            identity, *frames = self._sock.recv_multipart()
            self._answer(identity, frames[-1] if frames else b"", waiting)

    def _answer(self, identity: bytes, request: bytes, waiting: list[tuple[bytes, bytes]]) -> None:
        with self._lock:  # (the history changes under set_current)
            reply = serve_request(request, self._current, self._chunks.port, self._deltas)
        if reply:
            self._sock.send_multipart([identity, *reply], copy=False)
        else:
            waiting.append((identity, request))

    def close(self) -> None:
        """Stop serving and release the port."""
        self._chunks.close()
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._ctx.term()


def fetch_buckets(
    endpoint: str,
    version: int,
    checksum: str | None,
    timeout_s: float,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    abandoned: threading.Event | None = None,
) -> Iterator[ReceivedTensor]:
    """Pull every bucket of ``version`` from ``endpoint`` and yield its tensors in order.

    Nothing is yielded until all buckets arrived within ``timeout_s`` and the checksum over them
    equals ``checksum`` (when given): a failed sync raises :class:`WeightSyncError` before the
    caller has applied anything. A server that does not answer the connection within
    ``CONNECT_TIMEOUT_S``, or that goes away mid-transfer, fails the sync at once; so does
    ``abandoned`` being set (within ``ABANDON_POLL_S``). Memory: one host copy of the weights while
    they are applied.
    """
    with _connect(endpoint, version, time.monotonic() + timeout_s, context, abandoned) as link:
        received = _receive_all(link)
    headers = [bytes(header) for header, _, _ in received]
    digests = [chunk_digests(data, reply.chunk_bytes) for _, reply, data in received]
    actual = version_checksum(version, headers, [len(data) for _, _, data in received], digests)
    check_checksum(actual, checksum, version, endpoint)
    for _, reply, data in received:
        yield from decode_bucket(reply, data)


def check_checksum(actual: str, expected: str | None, version: int, endpoint: str) -> None:
    """WeightSyncError unless ``actual`` is ``expected`` (None: not checked)."""
    if expected is not None and actual != expected:
        raise WeightSyncError(
            f"checksum mismatch for version {version} from {endpoint}: got {actual}, expected {expected}"
        )


def fetch_manifest(
    endpoint: str,
    version: int,
    checksum: str | None,
    deadline: float,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    abandoned: threading.Event | None = None,
) -> Manifest:
    """The :class:`Manifest` of ``version`` from the weight server at ``endpoint``, checked against
    ``checksum`` (None: not checked); the same connection deadlines and errors as :func:`fetch_buckets`
    (``deadline`` on ``time.monotonic()``)."""
    with _connect(endpoint, version, deadline, context, abandoned) as link:
        link.sock.send(_encoder.encode(ManifestRequest(version, WIRE_PROTOCOL)))
        link.wait_reply("0/?")
        frame = link.sock.recv()
    try:
        reply = _reply_decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise WeightSyncError(f"undecodable reply from {endpoint}: {e}") from e
    if isinstance(reply, ErrorReply):
        raise WeightSyncError(f"weight server {endpoint} refused: {reply.message}")
    if not isinstance(reply, Manifest) or reply.version != version:
        raise WeightSyncError(f"malformed manifest reply from {endpoint}")
    if reply.protocol != WIRE_PROTOCOL:
        raise WeightSyncError(
            f"weight server {endpoint} speaks wire protocol {reply.protocol}, this receiver protocol {WIRE_PROTOCOL}: "
            "run the same streamrl release on the learner and the rollout workers"
        )
    if any(len(d) != DIGEST_BYTES for chunks in reply.digests for d in chunks):
        raise WeightSyncError(f"malformed manifest from {endpoint}: a digest is not {DIGEST_BYTES} bytes")
    actual = version_checksum(version, reply.headers, reply.bucket_bytes, reply.digests)
    check_checksum(actual, checksum, version, endpoint)
    return reply


def fetch_delta(
    endpoint: str,
    version: int,
    base_version: int,
    base_checksum: str,
    deadline: float,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    abandoned: threading.Event | None = None,
) -> list[memoryview] | str:
    """The links (in order) from the held ``base_version`` to ``version`` from the weight server at
    ``endpoint``, or the server's reason for sending none; the same deadlines and errors as
    :func:`fetch_manifest`. Nothing here is trusted: the caller checks the result's digests."""
    with _connect(endpoint, version, deadline, context, abandoned) as link:
        link.sock.send(_encoder.encode(DeltaRequest(version, base_version, base_checksum, WIRE_PROTOCOL)))
        link.wait_reply("0/?")
        frames = link.sock.recv_multipart(copy=False)
    try:
        reply = _reply_decoder.decode(frames[0].buffer)
    except msgspec.DecodeError as e:
        raise WeightSyncError(f"undecodable reply from {endpoint}: {e}") from e
    if isinstance(reply, ErrorReply):
        raise WeightSyncError(f"weight server {endpoint} refused: {reply.message}")
    if isinstance(reply, NoDelta) and reply.version == version:
        return reply.reason
    if not isinstance(reply, DeltaReply) or reply.version != version or reply.links != len(frames) - 1:
        raise WeightSyncError(f"malformed delta reply from {endpoint}")
    return [frame.buffer for frame in frames[1:]]


@contextmanager
def _connect(
    endpoint: str,
    version: int,
    deadline: float,
    context: zmq.Context[zmq.Socket[bytes]] | None,
    abandoned: threading.Event | None,
) -> Iterator[_Link]:
    """A DEALER connected to ``endpoint`` with its connection monitor, as a :class:`_Link`."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(endpoint)
        yield _Link(sock, monitor, endpoint, version, deadline, abandoned)
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


class _Link:
    """A receiver's connection to one weight server for one fetch: waits for replies under the fetch's
    deadlines, watching the connection (handshake done, peer gone) and the caller's abandon flag."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        monitor: zmq.Socket[bytes],
        endpoint: str,
        version: int,
        deadline: float,
        abandoned: threading.Event | None,
    ) -> None:
        self.sock, self.monitor, self.endpoint, self.version = sock, monitor, endpoint, version
        self.deadline = deadline
        self.connect_deadline = min(deadline, time.monotonic() + CONNECT_TIMEOUT_S)
        self.connected = False
        self.abandoned = abandoned
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)

    def wait_reply(self, progress: str) -> None:
        """Return once a reply is ready to read; WeightSyncError naming why there will be none
        (``progress``: the buckets received so far, for the message)."""
        what = f"weight sync of version {self.version} from {self.endpoint}"
        while True:
            if self.abandoned is not None and self.abandoned.is_set():
                raise WeightSyncError(f"{what} abandoned ({progress} buckets received)")
            limit = self.deadline if self.connected else self.connect_deadline
            left = limit - time.monotonic()
            if left <= 0:
                if not self.connected and limit < self.deadline:
                    raise WeightSyncError(
                        f"{what}: the server did not answer the connection within its deadline "
                        f"({CONNECT_TIMEOUT_S:g} s; is the learner gone?)"
                    )
                raise WeightSyncError(f"{what} missed its deadline ({progress} buckets received)")
            ready = dict(self.poller.poll(int(min(left, ABANDON_POLL_S) * 1000) + 1))
            if self.sock in ready:
                return
            if self.monitor in ready:
                event = recv_monitor_message(self.monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.connected = True
                elif event == zmq.EVENT_DISCONNECTED:
                    raise WeightSyncError(f"{what}: the server went away ({progress} buckets received)")


def _receive_all(link: _Link) -> list[tuple[memoryview, BucketHeader, memoryview]]:
    """Request buckets with ``PIPELINE_DEPTH`` in flight until all arrived; return each one's header
    frame, decoded header and data (replies arrive in request order on one connection)."""
    sock, version, endpoint = link.sock, link.version, link.endpoint
    num_buckets: int | None = None
    next_index = 0
    in_flight = 0
    received: list[tuple[memoryview, BucketHeader, memoryview]] = []
    while num_buckets is None or len(received) < num_buckets:
        # The bucket count is known only after the first reply: ask for bucket 0 alone first.
        limit = 1 if num_buckets is None else min(num_buckets, next_index + PIPELINE_DEPTH - in_flight)
        while next_index < limit:
            sock.send(_encoder.encode(BucketRequest(version, next_index, WIRE_PROTOCOL)))
            next_index += 1
            in_flight += 1
        link.wait_reply(f"{len(received)}/{num_buckets if num_buckets is not None else '?'}")
        frames = sock.recv_multipart(copy=False)
        in_flight -= 1
        header_bytes = frames[0].buffer
        try:
            reply = _reply_decoder.decode(header_bytes)
        except msgspec.DecodeError as e:
            raise WeightSyncError(f"undecodable reply from {endpoint}: {e}") from e
        if isinstance(reply, ErrorReply):
            raise WeightSyncError(f"weight server {endpoint} refused: {reply.message}")
        if (
            not isinstance(reply, BucketHeader)
            or reply.version != version
            or reply.index != len(received)
            or len(frames) != 2
        ):
            raise WeightSyncError(f"out-of-order or malformed bucket reply from {endpoint} (expected {len(received)})")
        num_buckets = reply.num_buckets
        received.append((header_bytes, reply, frames[1].buffer))
    return received
