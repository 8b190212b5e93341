"""Delta of a weights version against the one before it, in the wire's bucket layout (numpy only, no torch).

The weight server (:class:`~streamrl.common.weights.wire.BucketServer`) encodes, at each publish whose
bucket layout (every tensor's name, dtype, shape and offset) equals the previous version's, what changed
since that version: per tensor, the words whose bits differ (:func:`encode_words`, the encodings measured
in :mod:`streamrl.torchkit.delta`, which builds on the same functions). A receiver that holds the
previous version's verified bytes in its staging buffer applies it in place (:func:`apply_version_delta`)
and then checks every chunk digest of the new version; the encoding itself is not trusted.

Words: a tensor of a 2-byte dtype is compared as 16-bit words, of a 4-byte dtype as 32-bit words, any
other as bytes (values sent raw). NaN payloads and -0.0 travel exactly.

Index part (per tensor, the smallest): ``idx32`` (``c`` uint32 indices), ``gaps`` (LEB128 varints of the
gaps between changed indices minus one), ``bitmask`` (``ceil(n / 8)`` bytes, numpy ``packbits``),
``dense`` (no index part, all ``n`` words raw). Value part: ``raw`` (the ``c`` new words) or ``diff``
(``new - old`` per word, modulo the word, zigzag, LEB128: one byte for a move of up to 63 ulps).

Wire form of one link (:func:`encode_version_delta`): a 4-byte little-endian header length, a msgpack
header ``{"format": "streamrl.wire-delta.v1", "base_version", "version", "compression": "zlib" | "none",
"payload_bytes", "tensors": [[bucket, offset, nbytes, width, encoding, values, num_changed, index_bytes,
data_bytes], ...]}`` naming only the tensors that changed, then their ``index part + value part``
concatenated, zlib level 1 as one stream.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec
import numpy as np

WIRE_DELTA_FORMAT = "streamrl.wire-delta.v1"
ENCODINGS = ("idx32", "gaps", "bitmask", "dense")
"""Index encodings :func:`encode_words` chooses from (``none`` when nothing changed)."""
VALUE_CODINGS = ("raw", "diff")
"""Value codings it chooses from: the new words, or their differences as varints."""

ENCODE_THREADS = 8
"""Threads that encode a version's tensors at once (at most one per core)."""
_HEADER_LEN = struct.Struct("<I")
_WORD: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class WordsDelta(NamedTuple):
    """One tensor's changed words (``encoding`` ``none``: unchanged, empty ``data``)."""

    encoding: str
    values: str
    num_changed: int
    index_bytes: int
    """Bytes of ``data`` before the value part."""
    data: bytes | memoryview


def varint_encode(values: np.ndarray) -> np.ndarray:
    """LEB128 of integers in [0, 2**32), vectorised: 7 bits per byte, high bit = more bytes follow."""
    v = values.astype(np.uint32)
    if not len(v) or int(v.max()) < 1 << 7:  # every varint one byte: the common case (one-ulp diffs)
        return v.astype(np.uint8)
    lengths = np.searchsorted(np.array([1 << 7, 1 << 14, 1 << 21, 1 << 28], dtype=np.uint32), v, side="right") + 1
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(starts[-1] + lengths[-1]) if len(v) else 0, dtype=np.uint8)
    out[starts] = (v & 0x7F) | ((lengths > 1) << 7)
    sel = np.flatnonzero(lengths > 1)  # few when changes are dense enough for gaps to win
    for j in range(1, 5):
        if not len(sel):
            break
        out[starts[sel] + j] = ((v[sel] >> (7 * j)) & 0x7F) | ((lengths[sel] > j + 1) << 7)
        sel = sel[lengths[sel] > j + 1]
    return out


def varint_decode(data: np.ndarray, count: int) -> np.ndarray:
    """Inverse of :func:`varint_encode`; ``ValueError`` unless ``data`` holds exactly ``count`` varints."""
    ends = np.flatnonzero(data < 0x80)
    if len(ends) != count or (count and ends[-1] != len(data) - 1):
        raise ValueError(f"varint stream holds {len(ends)} values in {len(data)} bytes, expected {count}")
    if len(data) == count:  # every varint one byte: the common case (small gaps, one-ulp diffs)
        return data.astype(np.uint64)
    starts = np.empty(count, dtype=np.int64)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > 5:
        raise ValueError("varint longer than 5 bytes")
    out = (data[starts] & 0x7F).astype(np.uint64)
    sel = np.flatnonzero(lengths > 1)  # the few longer ones, by index
    for j in range(1, int(lengths.max())):
        out[sel] |= (data[starts[sel] + j].astype(np.uint64) & np.uint64(0x7F)) << np.uint64(7 * j)
        sel = sel[lengths[sel] > j + 1]
    return out


def decode_indices(encoding: str, data: np.ndarray, count: int, numel: int) -> np.ndarray:
    """Changed indices (int64) from an ``idx32`` or ``gaps`` index part; ``ValueError`` when malformed."""
    if encoding == "idx32":
        if len(data) != 4 * count:
            raise ValueError(f"idx32 part of {len(data)} bytes for {count} indices")
        idx = data.view("<u4").astype(np.int64)
    elif encoding == "gaps":
        idx = np.cumsum(varint_decode(data, count).astype(np.int64) + 1) - 1
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}")
    if count and int(idx.max()) >= numel:  # idx32 from a corrupt payload need not be sorted
        raise ValueError(f"changed index out of range for {numel} elements")
    return idx


def diff_varints(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``new - old`` per 2- or 4-byte word, wrapped to a signed word, zigzag-mapped, as LEB128 varints."""
    wide = np.int32 if new.itemsize == 2 else np.int64
    d = (new - old).view(np.int16 if new.itemsize == 2 else np.int32).astype(wide)  # unsigned words wrap
    return varint_encode((d << 1) ^ (d >> (8 * new.itemsize - 1)))


def undiff(old: np.ndarray, value_part: np.ndarray, count: int) -> np.ndarray:
    """The new words from the old ones and a ``diff`` value part (modular: every bit pattern)."""
    zigzag = varint_decode(value_part, count).astype(np.int64)
    new: np.ndarray = old + ((zigzag >> 1) ^ -(zigzag & 1)).astype(old.dtype)  # wraps to the unsigned word
    return new


def encode_words(
    old_w: np.ndarray,
    new_w: np.ndarray,
    encodings: Iterable[str] = ENCODINGS,
    value_codings: Iterable[str] = VALUE_CODINGS,
) -> WordsDelta:
    """The smallest encoding among ``encodings`` x ``value_codings`` of the words of ``new_w`` (flat,
    unsigned) whose bits differ from ``old_w``; ``diff`` only for 2- and 4-byte words."""
    encodings, value_codings = tuple(encodings), tuple(value_codings)
    mask = old_w != new_w
    count = int(np.count_nonzero(mask))
    numel, width = len(new_w), new_w.itemsize
    if count == 0:
        return WordsDelta("none", "raw", 0, 0, b"")
    changed = np.flatnonzero(mask)  # gathers by index are ~10x faster than by boolean mask here
    new_c = new_w[changed]
    value_parts = {"raw": new_c} if "raw" in value_codings or width not in (2, 4) else {}
    if "diff" in value_codings and width in (2, 4):
        value_parts["diff"] = diff_varints(old_w[changed], new_c)
    value_coding = min(value_parts, key=lambda v: value_parts[v].nbytes)
    value_bytes = value_parts[value_coding].nbytes
    size = {"idx32": 4 * count, "bitmask": (numel + 7) // 8, "dense": width * numel - value_bytes}
    others = [size[e] for e in encodings if e != "gaps"]
    gaps = None
    # gaps takes at least one byte per change: its varints are built only when it can win
    if "gaps" in encodings and (not others or count < min(others)):
        gaps = varint_encode(np.diff(changed, prepend=-1) - 1)
        size["gaps"] = len(gaps)
    best = min((e for e in encodings if e in size), key=size.__getitem__)
    if best == "dense":
        return WordsDelta("dense", "raw", count, 0, new_w.tobytes())
    if best == "bitmask":
        index = np.packbits(mask)
    elif best == "gaps":
        assert gaps is not None
        index = gaps
    else:
        index = changed.astype("<u4")
    return WordsDelta(best, value_coding, count, index.nbytes, index.tobytes() + value_parts[value_coding].tobytes())


def apply_words(flat: np.ndarray, delta: WordsDelta) -> None:
    """Write ``delta`` into ``flat`` (writable unsigned words) in place; ``ValueError`` when malformed."""
    data = np.frombuffer(delta.data, dtype=np.uint8)
    numel, count, word = len(flat), delta.num_changed, flat.dtype
    if delta.encoding == "none":
        return
    if delta.encoding == "dense":
        if len(data) != numel * word.itemsize:
            raise ValueError(f"dense payload of {len(data)} bytes for {numel} words")
        flat[:] = data.view(word)
        return
    if not 0 <= delta.index_bytes <= len(data):
        raise ValueError(f"index part of {delta.index_bytes} bytes in {len(data)}")
    index_part, value_part = data[: delta.index_bytes], data[delta.index_bytes :]
    where: np.ndarray
    if delta.encoding == "bitmask":
        if len(index_part) != (numel + 7) // 8:
            raise ValueError(f"bitmask of {len(index_part)} bytes for {numel} words")
        where = np.flatnonzero(np.unpackbits(index_part, count=numel))
        if len(where) != count:
            raise ValueError(f"bitmask flags {len(where)} words, header says {count}")
    else:
        where = decode_indices(delta.encoding, index_part, count, numel)
    if delta.values == "raw":
        if len(value_part) != count * word.itemsize:
            raise ValueError(f"{len(value_part)} value bytes for {count} words")
        flat[where] = value_part.view(word)
    elif delta.values == "diff" and word.itemsize in (2, 4):
        flat[where] = undiff(flat[where], value_part, count)
    else:
        raise ValueError(f"unknown value coding {delta.values!r} for {word.itemsize}-byte words")


def word_width(dtype: str) -> int:
    """Bytes per compared word for a wire dtype name (``bfloat16`` or a numpy name)."""
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    return itemsize if itemsize in (2, 4) else 1


class TensorSpan(NamedTuple):
    """Where one tensor lies in a version: bucket, byte offset in it, bytes, word width."""

    bucket: int
    offset: int
    nbytes: int
    width: int


def encode_version_delta(
    base_version: int,
    version: int,
    spans: Sequence[TensorSpan],
    old: Sequence[memoryview | bytes | bytearray],
    new: Sequence[memoryview | bytes | bytearray],
    zlib_level: int | None = 1,
) -> bytes:
    """One link's wire form (module docstring): what turns the buckets ``old`` into ``new``, which share
    the layout ``spans``."""

    def encode(span: TensorSpan) -> WordsDelta:
        word = _WORD[span.width]
        count = span.nbytes // span.width
        old_w = np.frombuffer(old[span.bucket], dtype=word, count=count, offset=span.offset)
        new_w = np.frombuffer(new[span.bucket], dtype=word, count=count, offset=span.offset)
        return encode_words(old_w, new_w)

    rows: list[list[Any]] = []
    parts: list[bytes | memoryview] = []
    with ThreadPoolExecutor(min(ENCODE_THREADS, os.cpu_count() or 1)) as pool:  # numpy lets go of the GIL
        for span, d in zip(spans, pool.map(encode, spans), strict=True):
            if d.encoding != "none":
                rows.append([*span, d.encoding, d.values, d.num_changed, d.index_bytes, len(d.data)])
                parts.append(d.data)
    payload = b"".join(parts)
    header = msgspec.msgpack.encode(
        {
            "format": WIRE_DELTA_FORMAT,
            "base_version": base_version,
            "version": version,
            "compression": "none" if zlib_level is None else "zlib",
            "payload_bytes": len(payload),
            "tensors": rows,
        }
    )
    body = payload if zlib_level is None else zlib.compress(payload, zlib_level)
    return b"".join([_HEADER_LEN.pack(len(header)), header, body])


def apply_version_delta(buckets: Sequence[memoryview], link: bytes | memoryview) -> tuple[int, int]:
    """Apply one link to the writable bucket data views ``buckets`` in place; its (base_version, version).

    ``ValueError`` when the link is malformed (buckets already written may then be neither version); the
    caller checks the result's digests in any case."""
    view = memoryview(link)
    try:
        (header_len,) = _HEADER_LEN.unpack_from(view)
        header = msgspec.msgpack.decode(view[_HEADER_LEN.size : _HEADER_LEN.size + header_len])
        if header["format"] != WIRE_DELTA_FORMAT:
            raise ValueError(f"not a {WIRE_DELTA_FORMAT} delta: {header['format']!r}")
        payload = inflate_payload(header, view[_HEADER_LEN.size + header_len :])
        offset = 0
        for bucket, start, nbytes, width, encoding, values, num_changed, index_bytes, size in header["tensors"]:
            if (
                not 0 <= bucket < len(buckets)
                or width not in _WORD
                or start < 0
                or start + nbytes > len(buckets[bucket])
            ):
                raise ValueError(f"tensor span {bucket}/{start}+{nbytes} outside the buckets")
            flat = np.frombuffer(buckets[bucket], dtype=_WORD[width], count=nbytes // width, offset=start)
            data = payload[offset : offset + size]
            apply_words(flat, WordsDelta(encoding, values, num_changed, index_bytes, data))
            offset += size
        if offset != len(payload):
            raise ValueError(f"payload of {len(payload)} bytes, header accounts for {offset}")
        return int(header["base_version"]), int(header["version"])
    except (struct.error, msgspec.DecodeError, zlib.error, KeyError, TypeError) as e:
        raise ValueError(f"malformed delta: {e}") from e


def inflate_payload(header: dict[str, Any], body: memoryview) -> memoryview:
    """The uncompressed payloads (a view of ``body`` when it was sent uncompressed), checked against the
    header's ``compression`` and ``payload_bytes`` (both delta formats, this one and ``streamrl.torchkit.delta``'s)."""
    expected = int(header["payload_bytes"])
    if header["compression"] == "none":
        payload = body
    elif header["compression"] == "zlib":
        inflater = zlib.decompressobj()
        payload = memoryview(inflater.decompress(body, expected + 1))  # never inflates past what the header says
        if not inflater.eof:
            raise ValueError("zlib stream truncated or longer than its header says")
    else:
        raise ValueError(f"unknown compression {header['compression']!r}")
    if len(payload) != expected:
        raise ValueError(f"payload of {len(payload)} bytes, header says {expected}")
    return payload


class Link(NamedTuple):
    """One served delta: what turns ``base_version`` (checksum ``base_checksum``) into ``version``."""

    base_version: int
    base_checksum: str
    version: int
    data: bytes
    """Its wire form (:func:`encode_version_delta`)."""


class DeltaHistory:
    """The chain of single-step links a weight server keeps: at most ``max_behind`` links, and at most
    ``max_fraction`` of the model's bytes in all (a longer chain would not be served: the full weights
    are cheaper then). Not thread-safe: the server holds its lock around each call.

    Example:
        history.add(Link(3, checksum_3, 4, data), full_bytes)   # at each publish whose layout matched
        history.add(None, full_bytes)                            # a new layout: no delta reaches it
        history.chain(3, checksum_3, 4)                          # -> [link] or a reason (str)
    """

    def __init__(self, max_behind: int, max_fraction: float) -> None:
        if max_behind < 0:
            raise ValueError(f"max_behind must be >= 0, got {max_behind}")
        if not 0 < max_fraction <= 1:
            raise ValueError(f"max_fraction must lie in (0, 1], got {max_fraction}")
        self.max_behind, self.max_fraction = max_behind, max_fraction
        self.links: list[Link] = []
        self.full_bytes = 0
        self.encoding: int | None = None
        """The version whose link the server is encoding now (its delta requests wait)."""

    @property
    def num_bytes(self) -> int:
        """Bytes held by the links."""
        return sum(len(link.data) for link in self.links)

    def add(self, link: Link | None, full_bytes: int) -> None:
        """Record the link to the version now served (None: none, the chain restarts there)."""
        self.full_bytes = full_bytes
        if link is None or (self.links and self.links[-1].version != link.base_version):
            self.links = []
        if link is None or self.max_behind == 0:
            return
        self.links.append(link)
        while self.links and (len(self.links) > self.max_behind or self.num_bytes >= self.max_fraction * full_bytes):
            self.links.pop(0)

    def chain(self, base_version: int, base_checksum: str, version: int) -> list[Link] | str:
        """The links from ``base_version`` (whose checksum must be ``base_checksum``) to ``version``, or
        why there are none."""
        if not self.links or self.links[-1].version != version:
            return f"no delta reaches version {version}"
        for i, link in enumerate(self.links):
            if link.base_version == base_version:
                if link.base_checksum != base_checksum:
                    return f"the held version {base_version} is not the one the deltas start from (another checksum)"
                return self.links[i:]
        oldest = self.links[0].base_version
        return f"version {base_version} is too far behind (deltas start at version {oldest}, {len(self.links)} kept)"
