"""Typed views of the redis-py replies streamrl reads (stream entries, pending lists, plain values).

redis-py declares a reply as the union of every form it can take: ``bytes | str`` whatever the
connection's ``decode_responses``, RESP2 lists or RESP3 maps, full entries or bare ids. streamrl's
clients never decode (payloads are msgpack bytes) and speak RESP2, but these helpers accept every
declared form, so a caller gets the one type it works with, checked where it is narrowed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

Entry = tuple[bytes, dict[bytes, bytes]]
"""A stream entry: its id and its fields (streamrl writes one, ``PAYLOAD_FIELD``)."""


class Pending(NamedTuple):
    """One row of ``XPENDING ... start end count``: the entry id and how often it was delivered."""

    entry_id: str
    delivered: int


def text(value: object) -> str:
    """A reply value (an entry id, a member, a key) as ``str``; ``TypeError`` for anything but bytes or str."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a bytes or str reply, got {value!r}")


def raw(value: bytes | str) -> bytes:
    """A reply value as ``bytes`` (encoded as UTF-8 if the client decoded it)."""
    return value if isinstance(value, bytes) else value.encode()


def read_entries(reply: object) -> list[Entry]:
    """The entries of a one-stream ``XREAD`` / ``XREADGROUP`` reply ([] for none): RESP2's
    ``[[stream, entries]]`` or RESP3's ``{stream: entries}``."""
    if not reply:
        return []
    if isinstance(reply, Mapping):
        streams = list(reply.values())
    elif isinstance(reply, Sequence):
        streams = [item[1] for item in reply]
    else:
        raise TypeError(f"unexpected stream read reply {reply!r}")
    return entries(streams[0])


def entries(reply: object) -> list[Entry]:
    """Full entries of an ``XRANGE`` / ``XCLAIM`` / read reply. An entry trimmed from the stream while
    pending comes back with no fields (None): it is kept with ``{}``, so callers can tell it apart."""
    if not reply:
        return []
    if not isinstance(reply, Sequence):
        raise TypeError(f"unexpected stream entries reply {reply!r}")
    out: list[Entry] = []
    for item in reply:
        entry_id, fields = item
        out.append((raw(entry_id), {raw(k): raw(v) for k, v in (fields or {}).items()}))
    return out


def entry_ids(reply: Iterable[object]) -> list[str]:
    """The ids of a ``JUSTID`` claim reply."""
    return [text(entry_id) for entry_id in reply]


def pending(reply: Iterable[Mapping[str, object]]) -> list[Pending]:
    """The rows of an ``XPENDING`` range reply."""
    return [Pending(text(row["message_id"]), count(row["times_delivered"])) for row in reply]


def count(value: object) -> int:
    """An integer reply (a count, a length); ``TypeError`` for anything else."""
    if isinstance(value, int):
        return value
    if isinstance(value, (bytes, str)):
        return int(value)
    raise TypeError(f"expected an integer reply, got {value!r}")
