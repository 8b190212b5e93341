"""Poison entries: what a buggy or hostile writer could put on any stream of a run.

Each kind is built from a real entry of the stream (so only the one defect differs), and every
kind a consumer group reads must be dead-lettered with a reason that says what is wrong:

==================  ===========================================================  ==================
kind                payload                                                      reason contains
==================  ===========================================================  ==================
undecodable         ``0xc1`` (never valid msgpack) + random bytes                ``undecodable``
unknown type        ``{"type": "bogus", "v": 1}``                                ``unknown message type``
wrong version       the real entry with ``"v": 99``                              ``unsupported version``
invalid schema      the real entry's type and version, required fields missing   ``invalid``
wrong message type  a well-formed Heartbeat                                      ``expected``
oversized           the real entry padded past ``redis.max_message_mb``          ``MessageTooLarge``
==================  ===========================================================  ==================

The batches stream gets three more, well-formed but out of order: a batch from the future (index
1000, a trained batch's samples), a batch from the past (other content at a trained batch's index:
a conflicting copy; an exact copy is skipped quietly, tests/integration/test_learner_ambiguous.py),
and an oversized batch from the future; each must be dead-lettered, never trained. The followed
streams (``weights``, ``dead``) have no consumer group: their readers must pass over bad entries and
go on; ``weights`` also gets a forged event (a new version, signed with another key, pointing at a
port where nothing listens), and ``dead`` a forged letter about a batch (issue 38, finding 5: the learner's
"skipped untrained" letter, unsigned, naming a batch not trained yet - honoured, it would delete the batch's samples).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec

from streamrl.common.codec import decode, encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import (
    BATCH_SKIPPED,
    BatchManifest,
    DeadLetter,
    Heartbeat,
    Message,
    TrainingBatch,
    WeightsPublished,
)
from streamrl.common.weights.auth import sign

PAD_FIELD_BYTES = 3 * 2**19
"""Padding of an oversized entry (1.5 MiB): past a 1 MiB ``redis.max_message_mb``."""


@dataclass(frozen=True)
class Poison:
    """One entry to write, and what its dead letter's reason must contain ("": any reason; None: no dead
    letter expected, the stream has no consumer group)."""

    kind: str
    payload: bytes
    reason: str | None


def _builtins(message: Message) -> dict[str, Any]:
    return msgspec.to_builtins(message, builtin_types=(bytes,))  # type: ignore[no-any-return]


def _padded(message: Message) -> bytes:
    """``message``, still well-formed, grown past 1 MiB through a free-form field."""
    data = _builtins(message)
    pad = "x" * PAD_FIELD_BYTES
    if "samples" in data and "trajectory" in data["samples"][0]:  # a batch
        data["samples"][0]["trajectory"]["metadata"] = {"pad": pad}
    elif "samples" in data:  # a batch's manifest: a sample's reference
        data["samples"][0]["traceparent"] = pad
    elif "trajectory" in data:  # a scored trajectory
        data["trajectory"]["metadata"] = {"pad": pad}
    elif "metadata" in data:  # a prompt or a trajectory
        data["metadata"] = {"pad": pad}
    elif "payload" in data:  # a dead letter
        data["payload"] = pad.encode()
    else:  # a weights event
        data["endpoint"] = "tcp://127.0.0.1:9/" + pad
    return msgpack.packb(data)


def malformed(real: Message, *, oversized: bool = True) -> list[Poison]:
    """The six kinds of the table for a stream whose entries look like ``real``."""
    data = _builtins(real)
    beat = Heartbeat(service="faults", instance="poison", pid=0, ts=time.time())
    kinds = [
        Poison("undecodable", b"\xc1" + os.urandom(63), "undecodable"),
        Poison("unknown type", msgpack.packb({"type": "bogus", "v": 1}), "unknown message type"),
        Poison("wrong version", msgpack.packb({**data, "v": 99}), "unsupported version"),
        Poison("invalid schema", msgpack.packb({"type": data["type"], "v": data["v"], "id": 12345}), "invalid"),
        Poison("wrong message type", encode(beat), "expected"),
    ]
    if oversized:
        kinds.append(Poison("oversized", _padded(real), "MessageTooLarge"))
    return kinds


def out_of_order_batches(trained: TrainingBatch | BatchManifest) -> list[Poison]:
    """Well-formed batches that must never be trained: from the future, from the past, oversized."""
    future = msgspec.structs.replace(trained, id="batch-1000", index=1000)
    huge = msgspec.structs.replace(trained, id="batch-2000", index=2000)
    past = msgspec.structs.replace(
        trained, id=f"{trained.id}-other", samples=trained.samples[:-1], staleness=trained.staleness[:-1]
    )
    return [
        Poison("batch from the future", encode(future), ""),
        Poison("batch from the past", encode(past), ""),
        Poison("oversized batch from the future", _padded(huge), ""),
    ]


def forged_weights(real: WeightsPublished) -> Poison:
    """A newer version signed with another key, served from a port where nothing listens."""
    forged = msgspec.structs.replace(
        real, version=real.version + 500, step=real.step + 500, endpoint="tcp://127.0.0.1:9", checksum="0" * 64
    )
    return Poison("forged signature", encode(sign(forged, b"not-this-runs-key-0123456789", run_id="another-run")), None)


FORGED_LETTER_ENTRY = "0-2"
"""The entry id a forged batch letter names (the scenario marks it injected: the counting believes it no more than
the coordinator must)."""


def forged_batch_letter(victim: BatchManifest, stream: str) -> DeadLetter:
    """The learner's letter for ``victim`` (on ``stream``, the run's batches) as any credential can write it: unsigned."""
    return DeadLetter(
        stream=stream,
        entry_id=FORGED_LETTER_ENTRY,
        group="learner",
        consumer="learner",
        error=f"{victim.id} ({victim.num_samples} samples) {BATCH_SKIPPED}: forged",
        deliveries=1,
        payload=encode(victim),
        ts=time.time(),
    )


def first_message(entries: list[tuple[bytes, dict[bytes, bytes]]], kind: type[Message]) -> tuple[Any, bytes]:
    """The first entry of ``entries`` that decodes as ``kind``, and its payload."""
    for _, fields in entries:
        payload = fields.get(b"d", b"")
        try:
            return decode(payload, kind), payload
        except PoisonMessageError:
            continue
    raise AssertionError(f"no {kind.__name__} on the stream yet")
