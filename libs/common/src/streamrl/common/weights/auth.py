"""Signed weights events: a rollout worker loads weights only from the run's learner.

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
themselves: over ZMQ it is blake2b over every byte served; over the broadcast group the event also
carries the buckets' block checksum (``WeightsBroadcast.checksum``), and a member loads a version
only when what it received hashes to it - whatever the group's unauthenticated store offers; over
IPC the signed event fixes where the weights come from (buffers on the learner's GPU).
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


def _digest(event: WeightsPublished, key: bytes, run_id: str) -> str:
    # the run id, then the event: a run id holds no NUL (ServiceConfig.run_id's pattern), so the split is unambiguous
    signed = b"streamrl-weights\0" + run_id.encode() + b"\0" + encode(msgspec.structs.replace(event, signature=""))
    return hmac.new(key, signed, hashlib.sha256).hexdigest()


def sign(event: WeightsPublished, key: bytes | None, *, run_id: str) -> WeightsPublished:
    """``event`` with its signature for run ``run_id`` (unchanged when there is no key)."""
    return event if key is None else msgspec.structs.replace(event, signature=_digest(event, key, run_id))


def check(event: WeightsPublished, key: bytes | None, *, run_id: str) -> None:
    """Raise :class:`WeightsAuthError` unless ``event`` is signed with ``key`` for run ``run_id`` (no key:
    nothing to check)."""
    if key is None:
        return
    if not event.signature:
        raise WeightsAuthError(f"weights version {event.version} is not signed; this worker requires {KEY_ENV}'s key")
    if not hmac.compare_digest(event.signature, _digest(event, key, run_id)):
        raise WeightsAuthError(
            f"weights version {event.version} is not signed with this run's key ({KEY_ENV}) for run {run_id!r}: "
            "refused (another key, an event of another run replayed, or an altered event)"
        )
