"""Delta weight sync: what changed between two versions of a named tensor set, as bytes, applied in place.

A rollout worker that holds version ``v - k`` needs only the elements whose bit patterns changed
since. Pure functions over named torch tensors, no I/O, built on the numpy core that the weight
plane uses (:mod:`streamrl.common.weights.delta`: the same word encodings over the wire's bucket layout,
served by the ``zmq`` transport, issue 39 item 3); these are the tensor-level API and what
``bench/weights_delta.py`` measures the encodings with:

* :func:`encode_delta` (sender, holds both versions) -> :class:`Delta`;
  :func:`delta_to_bytes` / :func:`delta_from_bytes` put it on the wire and back.
* :func:`apply_delta` (receiver): refuses a delta whose names, dtypes or shapes differ from the tensors
  it holds (``ValueError``) before writing anything, writes the changed elements in place, then
  checks :func:`weights_digest` of the result against the new version's digest carried in the delta.
  A failed check raises :class:`DeltaChecksumError`: the tensors are then neither version and the
  receiver must fetch the full weights. That check, not the encoding, is what guarantees the result.
* :func:`plan_sync`: the pure policy, full weights or a chain of deltas (see its docstring).

Elements are compared and written as raw words (bf16/fp16 as 16-bit, fp32 as 32-bit integers), so
NaN payloads and -0.0 travel exactly. Per tensor (``n`` elements, ``c`` changed, ``w`` bytes each)
the smallest index part x value part is sent:

``idx32``   index part: ``c`` little-endian uint32 indices (``4c`` bytes).
``gaps``    index part: the gaps between changed indices minus one, as LEB128 varints (1 byte below
            128, 2 below 16,384, ...): about ``c`` bytes while changes are denser than 1 in 128.
``bitmask`` index part: ``ceil(n / 8)`` bytes of changed flags (numpy ``packbits``, big-endian bit
            order): wins above about 1 change in 8.
``dense``   no index part, all ``n`` words raw: when nearly every element changed.
``none``    nothing changed (empty payload).

``raw``     value part: the ``c`` new words (``wc`` bytes).
``diff``    value part: ``new - old`` per word, modulo ``2**(8w)`` as a signed word, zigzag-mapped,
            LEB128: 1 byte for a move of up to 63 units in the last place - what an optimizer step
            does to a bf16 weight. Modular, so every bit pattern round-trips; it needs the exact
            base, which the digest check enforces anyway (a wrong base fails it, as with ``raw``).

Then the whole payload goes through zlib level 1 (the stdlib's; zstandard and lz4 are not installed
here): the gap and diff varints are mostly small, and it saved another 1.4-1.6x on real steps.

Candidates measured on the weights of real GRPO steps (``bench/weights_delta.py``, the demo's 0.66M
model, bf16, the last of 24 steps, bytes as a fraction of the full 1.32 MB; 2026-12-07)::

    lr (recipe)            changed  idx32+raw  gaps+raw  bitmask+raw  gaps+diff  bitmask+diff  +zlib1  xor+zlib1
    1e-6 (gpu_7b_full)     1.8%     0.054      0.029     0.082        0.020      0.073         0.014   0.034
    5e-6 (gpu_arithmetic)  6.3%     0.177      0.089     0.123        0.060      0.094         0.038   0.085
    1e-4 (demo)            37%      1.03       0.52      0.41         0.35       0.24          0.15    0.26

XOR of all words through zlib level 1 (what a generic compressor gets) was larger than the chosen
encoding before its zlib stage at every lr, and slower to encode on one core (4.7 against 3.4 CPU
s/GB).

``delta_bytes_ratio`` (full bytes / wire bytes, this wire form, mean over 17 versions): 68x, 44x,
28x for 1, 2, 4 versions behind at lr 1e-6; 25x, 16x, 11x at 5e-6; 6.1x, 4.5x, 3.5x at 1e-4 (the demo
publishes fp32, where 99.95% of the elements change per step: 1.6x). From the demo's tiny model,
not the GPU recipes' Qwen2 shapes: docs/benchmarks.md ("Delta weight sync") says how far it carries.
A direct ``v - k -> v`` delta is smaller than the chain of ``k`` single steps (11x against 6x at
5e-6, k = 4): elements that move twice are sent once. One CPU thread per GB of full weights:
encode 3.4 s (digest included), zlib 1.0 s, apply 1.6 s, digest check 1.1 s.

Wire form (:func:`delta_to_bytes`): a 4-byte little-endian header length, a msgpack header
``{"format": "streamrl.delta.v1", "base_version", "version", "checksum", "compression": "zlib" |
"none", "payload_bytes", "tensors": [[name, dtype, shape, encoding, values, num_changed,
index_bytes, num_bytes], ...]}`` listing every tensor of the set in the sender's order, then the
payload: the tensors' ``index part + value part`` concatenated in that order, zlib-compressed as one
stream unless ``compression`` is ``none``.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np
import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.weights.delta import (
    ENCODINGS,
    VALUE_CODINGS,
    decode_indices,
    encode_words,
    inflate_payload,
    undiff,
)

DELTA_FORMAT = "streamrl.delta.v1"

_WORDS: dict[torch.dtype, tuple[torch.dtype, np.dtype[Any]]] = {
    torch.bfloat16: (torch.int16, np.dtype("<u2")),
    torch.float16: (torch.int16, np.dtype("<u2")),
    torch.float32: (torch.int32, np.dtype("<u4")),
}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_HEADER_LEN = struct.Struct("<I")


class DeltaChecksumError(WeightSyncError):
    """The tensors after :func:`apply_delta` do not hash to the new version: fetch the full weights."""


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's changed elements in one :data:`ENCODINGS` form (``none``: unchanged, empty ``data``)."""

    name: str
    dtype: str
    """``bfloat16``, ``float16`` or ``float32``."""
    shape: tuple[int, ...]
    encoding: str
    """Index part: one of :data:`ENCODINGS` or ``none``."""
    values: str
    """Value part: one of :data:`VALUE_CODINGS` (``raw`` for ``dense`` and ``none``)."""
    num_changed: int
    index_bytes: int
    """Bytes of ``data`` before the value part."""
    data: bytes | memoryview


@dataclass(frozen=True)
class Delta:
    """What turns version ``base_version`` of a tensor set into ``version``.

    Example:
        delta = encode_delta(old, new, base_version=3, version=4)
        apply_delta(held, delta_from_bytes(delta_to_bytes(delta)))   # held: version 3 -> 4, checked
    """

    base_version: int
    version: int
    checksum: str
    """:func:`weights_digest` of version ``version``."""
    tensors: tuple[TensorDelta, ...]

    @property
    def num_bytes(self) -> int:
        """Uncompressed payload bytes (the wire form adds a header of a few dozen bytes per tensor and
        compresses the payload unless told not to)."""
        return sum(len(t.data) for t in self.tensors)


def _words(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements as a flat host array of unsigned words (a view when already on the CPU)."""
    if tensor.dtype not in _WORDS:
        raise ValueError(f"delta sync takes bfloat16, float16 or float32 tensors, got {tensor.dtype}")
    int_dtype, np_dtype = _WORDS[tensor.dtype]
    host = tensor.detach().to("cpu").contiguous()
    return host.view(int_dtype).numpy().view(np_dtype).reshape(-1)


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """blake2b (16 bytes, hex) over every tensor's name, dtype, shape and bytes, in sorted name order.

    Both sides compute it the same way whatever order they hold the tensors in.
    """
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(_words(t).view(np.uint8).data)
    return h.hexdigest()


def encode_tensor(
    name: str,
    old: torch.Tensor,
    new: torch.Tensor,
    encodings: Iterable[str] = ENCODINGS,
    value_codings: Iterable[str] = VALUE_CODINGS,
) -> TensorDelta:
    """The smallest encoding among ``encodings`` x ``value_codings`` of the elements of ``new`` whose
    bits differ from ``old``."""
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(f"{name}: {old.dtype} {tuple(old.shape)} -> {new.dtype} {tuple(new.shape)}, not one tensor")
    if new.numel() >= 2**32:
        raise ValueError(f"{name}: {new.numel()} elements, delta sync indexes at most 2**32 per tensor")
    old_w, new_w = _words(old), _words(new)
    d = encode_words(old_w, new_w, encodings, value_codings)
    return TensorDelta(name, _DTYPE_NAMES[new.dtype], tuple(new.shape), *d)


def _check_same_set(names: Iterable[str], held: Mapping[str, object], what: str) -> None:
    names = set(names)
    if names != set(held):
        missing, extra = sorted(set(held) - names), sorted(names - set(held))
        raise ValueError(f"{what}: tensor names differ (only held: {missing[:5]}, only in delta: {extra[:5]})")


def encode_delta(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    base_version: int,
    version: int,
    encodings: Iterable[str] = ENCODINGS,
    value_codings: Iterable[str] = VALUE_CODINGS,
) -> Delta:
    """The delta from ``old`` (``base_version``) to ``new`` (``version``): same names, dtypes, shapes.

    Per tensor the smallest of ``encodings`` x ``value_codings`` (restrict them to measure one alone).
    """
    _check_same_set(new, old, "encode_delta")
    encodings, value_codings = tuple(encodings), tuple(value_codings)
    if not encodings or set(encodings) - set(ENCODINGS):
        raise ValueError(f"encodings must be some of {ENCODINGS}, got {encodings}")
    if not value_codings or set(value_codings) - set(VALUE_CODINGS):
        raise ValueError(f"value_codings must be some of {VALUE_CODINGS}, got {value_codings}")
    tensors = tuple(encode_tensor(name, old[name], new[name], encodings, value_codings) for name in new)
    return Delta(base_version, version, weights_digest(new), tensors)


def _apply_tensor(held: torch.Tensor, td: TensorDelta) -> None:
    """Decode ``td`` and write its values into ``held``; ``ValueError`` when the payload is malformed."""
    int_dtype, np_dtype = _WORDS[held.dtype]
    signed = np.int16 if np_dtype.itemsize == 2 else np.int32
    data = np.frombuffer(td.data, dtype=np.uint8)
    flat = held.view(int_dtype).view(-1)
    numel, count = held.numel(), td.num_changed
    if td.encoding == "dense":
        if len(data) != numel * np_dtype.itemsize:
            raise ValueError(f"{td.name}: dense payload of {len(data)} bytes for {numel} elements")
        flat.copy_(torch.from_numpy(data.view(signed).copy()))
        return
    if not 0 <= td.index_bytes <= len(data):
        raise ValueError(f"{td.name}: index part of {td.index_bytes} bytes in {len(data)}")
    index_part, value_part = data[: td.index_bytes], data[td.index_bytes :]
    if td.encoding == "bitmask":  # a boolean mask, no index array
        if len(index_part) != (numel + 7) // 8:
            raise ValueError(f"{td.name}: bitmask of {len(index_part)} bytes for {numel} elements")
        flags = np.unpackbits(index_part, count=numel)
        if int(np.count_nonzero(flags)) != count:
            raise ValueError(f"{td.name}: bitmask flags {np.count_nonzero(flags)} elements, header says {count}")
        where: torch.Tensor = torch.from_numpy(flags).view(torch.bool).to(held.device)
    else:
        where = torch.from_numpy(decode_indices(td.encoding, index_part, count, numel)).to(held.device)
    if td.values == "raw":
        if len(value_part) != count * np_dtype.itemsize:
            raise ValueError(f"{td.name}: {len(value_part)} value bytes for {count} values")
        values = torch.from_numpy(value_part.view(signed).copy()).to(held.device)
    elif td.values == "diff":
        old = flat[where].cpu().numpy().view(np_dtype)
        values = torch.from_numpy(undiff(old, value_part, count).view(signed)).to(held.device)
    else:
        raise ValueError(f"{td.name}: unknown value coding {td.values!r}")
    if td.encoding == "bitmask":
        flat.masked_scatter_(where, values)
    else:
        flat[where] = values


def apply_delta(tensors: Mapping[str, torch.Tensor], delta: Delta, verify: bool = True) -> None:
    """Write ``delta``'s changed elements into ``tensors`` (in place, any device), then check the digest.

    Raises ``ValueError`` before writing anything when a name, dtype or shape differs, or when a
    tensor is not contiguous; :class:`DeltaChecksumError` when a payload is malformed or the result
    is not the new version: the tensors are then neither version (fetch the full weights).
    ``verify=False`` skips the digest: for the inner links of a chain, checked once at its end.
    """
    _check_same_set((t.name for t in delta.tensors), tensors, f"delta {delta.base_version}->{delta.version}")
    for td in delta.tensors:
        held = tensors[td.name]
        if _DTYPE_NAMES.get(held.dtype) != td.dtype or tuple(held.shape) != td.shape:
            raise ValueError(f"{td.name}: held {held.dtype} {tuple(held.shape)}, delta has {td.dtype} {td.shape}")
        if not held.is_contiguous():
            raise ValueError(f"{td.name}: apply_delta writes contiguous tensors only")
    for td in delta.tensors:
        if td.encoding != "none":
            try:
                _apply_tensor(tensors[td.name], td)
            except ValueError as e:  # earlier tensors are written already: neither version now
                raise DeltaChecksumError(f"corrupt delta {delta.base_version}->{delta.version}: {e}") from e
    if verify and weights_digest(tensors) != delta.checksum:
        raise DeltaChecksumError(
            f"weights after delta {delta.base_version}->{delta.version} do not match its checksum: fetch full weights"
        )


def delta_to_bytes(delta: Delta, zlib_level: int | None = 1) -> bytes:
    """The wire form (module docstring): header length, msgpack header, payloads (zlib-compressed
    as one stream at ``zlib_level``; None = uncompressed)."""
    payload = b"".join(t.data for t in delta.tensors)
    header = msgspec.msgpack.encode(
        {
            "format": DELTA_FORMAT,
            "base_version": delta.base_version,
            "version": delta.version,
            "checksum": delta.checksum,
            "compression": "none" if zlib_level is None else "zlib",
            "payload_bytes": len(payload),
            "tensors": [
                [t.name, t.dtype, list(t.shape), t.encoding, t.values, t.num_changed, t.index_bytes, len(t.data)]
                for t in delta.tensors
            ],
        }
    )
    body = payload if zlib_level is None else zlib.compress(payload, zlib_level)
    return b"".join([_HEADER_LEN.pack(len(header)), header, body])


def delta_from_bytes(buf: bytes | memoryview) -> Delta:
    """Parse :func:`delta_to_bytes` output; ``ValueError`` when malformed."""
    view = memoryview(buf)
    try:
        (header_len,) = _HEADER_LEN.unpack_from(view)
        header = msgspec.msgpack.decode(view[_HEADER_LEN.size : _HEADER_LEN.size + header_len])
        if header["format"] != DELTA_FORMAT:
            raise ValueError(f"not a {DELTA_FORMAT} delta: {header['format']!r}")
        payload = inflate_payload(header, view[_HEADER_LEN.size + header_len :])
        offset, tensors = 0, []
        for name, dtype, shape, encoding, values, num_changed, index_bytes, num_bytes in header["tensors"]:
            data = payload[offset : offset + num_bytes]
            tensors.append(TensorDelta(name, dtype, tuple(shape), encoding, values, num_changed, index_bytes, data))
            offset += num_bytes
        if offset != len(payload):
            raise ValueError(f"payload of {len(payload)} bytes, header accounts for {offset}")
        return Delta(header["base_version"], header["version"], header["checksum"], tuple(tensors))
    except (struct.error, msgspec.DecodeError, zlib.error, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed delta: {e}") from e


@dataclass(frozen=True)
class DeltaInfo:
    """A delta the sender can serve: ``base_version`` -> ``version`` in ``num_bytes`` wire bytes."""

    base_version: int
    version: int
    num_bytes: int


@dataclass(frozen=True)
class SyncPlan:
    """What a receiver should fetch: nothing, a chain of deltas (applied in order), or the full weights."""

    kind: Literal["none", "delta", "full"]
    deltas: tuple[DeltaInfo, ...]
    num_bytes: int
    reason: str


def _cheapest_chain(
    held_version: int, current_version: int, available: Iterable[DeltaInfo]
) -> tuple[int, tuple[DeltaInfo, ...]] | None:
    """(bytes, links) of the cheapest chain of deltas from ``held_version`` to ``current_version``, or None."""
    links: dict[int, list[DeltaInfo]] = {}
    for d in available:
        if held_version <= d.base_version < d.version <= current_version:
            links.setdefault(d.base_version, []).append(d)
    # links only go forward (a DAG): relax them in version order
    best: dict[int, tuple[int, tuple[DeltaInfo, ...]]] = {held_version: (0, ())}
    for v in sorted(links):
        if v in best:
            cost, chain = best[v]
            for d in links[v]:
                if d.version not in best or cost + d.num_bytes < best[d.version][0]:
                    best[d.version] = (cost + d.num_bytes, (*chain, d))
    return best.get(current_version)


def plan_sync(
    held_version: int | None,
    current_version: int,
    available: Iterable[DeltaInfo],
    full_bytes: int,
    max_delta_fraction: float = 0.5,
) -> SyncPlan:
    """Deltas from ``held_version`` to ``current_version`` when a chain exists and is cheap, else full weights.

    The chain is the one of fewest total bytes through ``available`` (forward links only; a link may
    span several versions). It is taken while its bytes stay below ``max_delta_fraction`` of
    ``full_bytes``: a worker far behind pays more for deltas than for the full weights, and a full
    fetch also resets a worker whose weights drifted (its check failed). ``held_version=None``
    (nothing held) or a held version ahead of the current one (a restarted learner) gets full weights.
    """
    if not 0 < max_delta_fraction <= 1:
        raise ValueError(f"max_delta_fraction must lie in (0, 1], got {max_delta_fraction}")
    if held_version is None:
        return SyncPlan("full", (), full_bytes, "no weights held")
    if held_version == current_version:
        return SyncPlan("none", (), 0, f"version {current_version} held")
    if held_version > current_version:
        return SyncPlan("full", (), full_bytes, f"held version {held_version} is ahead of {current_version}")
    found = _cheapest_chain(held_version, current_version, available)
    if found is None:
        return SyncPlan("full", (), full_bytes, f"no delta chain from version {held_version} to {current_version}")
    cost, chain = found
    if cost >= max_delta_fraction * full_bytes:
        return SyncPlan("full", (), full_bytes, f"deltas of {cost} bytes >= {max_delta_fraction} x {full_bytes}")
    return SyncPlan("delta", chain, cost, f"{len(chain)} delta(s) from version {held_version}")
