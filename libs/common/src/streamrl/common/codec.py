"""msgpack codec for bus messages: typed encode, and a decode that never crashes the caller.

Decoding first reads only the ``type``/``v`` header, so an unknown type or an unsupported
version is reported as exactly that (a :class:`PoisonMessageError`) instead of a schema error.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import MESSAGE_TYPES, SUPPORTED_VERSIONS, Message


class _Header(msgspec.Struct):
    type: str
    v: int


PAYLOAD_FIELD = b"d"
"""Field of a stream entry that holds the msgpack payload (re-exported by :mod:`streamrl.common.bus`)."""

_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_decoders = {tag: msgspec.msgpack.Decoder(cls) for tag, cls in MESSAGE_TYPES.items()}

M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    """Encode a message as a msgpack map (type tag and schema version included)."""
    return _encoder.encode(message)


def decode(data: bytes, expected: type[M] | tuple[type[Message], ...] | None = None) -> M:
    """Decode bytes into a message; anything unusable raises :class:`PoisonMessageError`."""
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise PoisonMessageError(f"undecodable message: {e}") from e
    if header.type not in _decoders:
        raise PoisonMessageError(f"unknown message type {header.type!r} (known: {sorted(_decoders)})")
    if header.v not in SUPPORTED_VERSIONS[header.type]:
        raise PoisonMessageError(
            f"unsupported version v={header.v} of {header.type!r} (supported: {sorted(SUPPORTED_VERSIONS[header.type])})"
        )
    try:
        message = _decoders[header.type].decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise PoisonMessageError(f"invalid {header.type!r} v{header.v} message: {e}") from e
    if expected is not None and not isinstance(message, expected):
        wanted = expected if isinstance(expected, tuple) else (expected,)
        tags = " or ".join(repr(t.__struct_config__.tag) for t in wanted)
        raise PoisonMessageError(f"expected a {tags} message, got a {header.type!r} message")
    return message  # type: ignore[return-value]
