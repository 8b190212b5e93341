"""Signed messages: a rollout worker loads weights only from the run's learner, and the coordinator drops a
batch only on the learner's word.

A ``WeightsPublished`` event tells every rollout worker where to take new weights (a ZMQ endpoint,
CUDA IPC buffers, a broadcast group's store) and what they must hash to. Anyone who can write to
Redis could otherwise point the workers at weights of their own. So the learner signs each event
with the run's weights key: ``signature`` = HMAC-SHA256 over the run id and the event's encoding
with an empty signature. The run id is part of what is signed: runs that share a key (one key for
a team's runs, or one Redis) cannot replay each other's events - an event of run A copied into run
B's ``weights`` stream is refused there. The key is never in an event, a log line or a run file: it
comes from the environment (``STREAMRL_WEIGHTS_KEY``; ``streamrl up`` makes a random one per run
when it is not set).

Rollout workers and the coordinator with a key refuse an event whose signature does not match
(:func:`check`), naming the version and the run; without a key they accept every event (and say
once that weights events are not authenticated). The signed checksum authenticates the weights
themselves: over ZMQ it is blake2b over every bucket header and the blake3 digest of every chunk
served (:func:`streamrl.common.weights.wire.version_checksum`); over the broadcast group the event also
carries the buckets' block checksum (``WeightsBroadcast.checksum``), and a member loads a version
only when what it received hashes to it - whatever the group's unauthenticated store offers; over
IPC the signed event fixes where the weights come from (buffers on the learner's GPU).

The same HMAC signs the other message that must come from the learner: a **dead letter about a batch**
(``DeadLetter.stream`` is a ``batches`` stream). The coordinator deletes the samples such a letter names and
counts its groups dropped, and every service can write to ``dead``; so the learner signs its batch letters
(its own and its consumer loop's), lane 0's joiner signs those it relays to the lanes, and a coordinator with
the key honours only signed ones (:func:`check_letter`): a forged letter deletes nothing and is counted as
forged. Each kind is signed under its own domain (its message tag), so a signature of one kind never passes for
another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import TypeVar

import msgspec

from streamrl.common.codec import encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import DeadLetter, WeightsPublished

KEY_ENV = "STREAMRL_WEIGHTS_KEY"
"""Environment variable holding the run's weights key (any string; at least 16 characters)."""


class WeightsAuthError(PoisonMessageError):
    """A weights event that is not signed with this run's key: never applied."""


class LetterAuthError(PoisonMessageError):
    """A dead letter about a batch that is not signed with this run's key: forged, never acted on."""


Signed = TypeVar("Signed", WeightsPublished, DeadLetter)
"""The messages signed with the run's key (each has a ``signature`` field)."""


def weights_key() -> bytes | None:
    """The run's weights key from the environment, or None when there is none (unset or empty)."""
    value = os.environ.get(KEY_ENV, "")
    if not value:
        return None
    if len(value) < 16:
        raise ValueError(f"{KEY_ENV} must be at least 16 characters long (got {len(value)})")
    return value.encode()


def _digest(message: WeightsPublished | DeadLetter, key: bytes, run_id: str) -> str:
    # the domain (the message's tag: "weights", "dead"), the run id, then the message: neither the tag nor a run id
    # holds a NUL (ServiceConfig.run_id's pattern), so the split is unambiguous
    domain = f"streamrl-{type(message).__struct_config__.tag}".encode()
    unsigned = encode(msgspec.structs.replace(message, signature=""))
    return hmac.new(key, domain + b"\0" + run_id.encode() + b"\0" + unsigned, hashlib.sha256).hexdigest()


def sign(message: Signed, key: bytes | None, *, run_id: str) -> Signed:
    """``message`` with its signature for run ``run_id`` (unchanged when there is no key)."""
    return message if key is None else msgspec.structs.replace(message, signature=_digest(message, key, run_id))


def _signed(message: WeightsPublished | DeadLetter, key: bytes, run_id: str) -> bool:
    return bool(message.signature) and hmac.compare_digest(message.signature, _digest(message, key, run_id))


def check(event: WeightsPublished, key: bytes | None, *, run_id: str) -> None:
    """Raise :class:`WeightsAuthError` unless ``event`` is signed with ``key`` for run ``run_id`` (no key:
    nothing to check)."""
    if key is None:
        return
    if not event.signature:
        raise WeightsAuthError(f"weights version {event.version} is not signed; this worker requires {KEY_ENV}'s key")
    if not _signed(event, key, run_id):
        raise WeightsAuthError(
            f"weights version {event.version} is not signed with this run's key ({KEY_ENV}) for run {run_id!r}: "
            "refused (another key, an event of another run replayed, or an altered event)"
        )


def check_letter(letter: DeadLetter, key: bytes | None, *, run_id: str) -> None:
    """Raise :class:`LetterAuthError` unless ``letter`` is signed with ``key`` for run ``run_id`` (no key: nothing
    to check). Only letters about batches need it (see the module docstring)."""
    if key is None or _signed(letter, key, run_id):
        return
    how = "not signed" if not letter.signature else "not signed with this run's key"
    raise LetterAuthError(
        f"a dead letter about {letter.stream} entry {letter.entry_id} (consumer {letter.consumer!r}) is {how} "
        f"({KEY_ENV}, run {run_id!r}): forged, refused - only the learner's letters about batches are honoured"
    )
