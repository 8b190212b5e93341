"""Signed weights events: a rollout worker loads weights only from the run's learner.

A ``WeightsPublished`` event tells every rollout worker where to take new weights (a ZMQ endpoint,
CUDA IPC buffers, a broadcast group's store) and what they must hash to. Anyone who can write to
Redis could otherwise point the workers at weights of their own. So the learner signs each event
with the run's weights key: ``signature`` = HMAC-SHA256 over the event's encoding with an empty
signature. The key is never in an event, a log line or a run file: it comes from the environment
(``STREAMRL_WEIGHTS_KEY``; ``streamrl up`` makes a random one per run when it is not set).

Rollout workers and the coordinator with a key refuse an event whose signature does not match
(:func:`check`), naming the version; without a key they accept every event (and say once that
weights events are not authenticated). Over ZMQ the signed checksum is blake2b over every byte
served, so the weights themselves are authenticated; over IPC and broadcast the signed event
fixes where they come from (buffers on the learner's GPU, the learner's own store).
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec

from streamrl.common.codec import encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import WeightsPublished

KEY_ENV = "STREAMRL_WEIGHTS_KEY"
"""Environment variable holding the run's weights key (any string; at least 16 characters)."""


class WeightsAuthError(PoisonMessageError):
    """A weights event that is not signed with this run's key: never applied."""


def weights_key() -> bytes | None:
    """The run's weights key from the environment, or None when there is none (unset or empty)."""
    value = os.environ.get(KEY_ENV, "")
    if not value:
        return None
    if len(value) < 16:
        raise ValueError(f"{KEY_ENV} must be at least 16 characters long (got {len(value)})")
    return value.encode()


def _digest(event: WeightsPublished, key: bytes) -> str:
    return hmac.new(key, encode(msgspec.structs.replace(event, signature="")), hashlib.sha256).hexdigest()


def sign(event: WeightsPublished, key: bytes | None) -> WeightsPublished:
    """``event`` with its signature (unchanged when there is no key)."""
    return event if key is None else msgspec.structs.replace(event, signature=_digest(event, key))


def check(event: WeightsPublished, key: bytes | None) -> None:
    """Raise :class:`WeightsAuthError` unless ``event`` is signed with ``key`` (no key: nothing to check)."""
    if key is None:
        return
    if not event.signature:
        raise WeightsAuthError(f"weights version {event.version} is not signed; this worker requires {KEY_ENV}'s key")
    if not hmac.compare_digest(event.signature, _digest(event, key)):
        raise WeightsAuthError(
            f"weights version {event.version} is signed with another key than this run's ({KEY_ENV}): refused"
        )
