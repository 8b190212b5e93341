"""A batch's payloads read by reference: what turns a :class:`BatchManifest` into the TrainingBatch it names.

The coordinator publishes a manifest (one small entry per batch); each of its refs carries the sample's
scored record and names the string holding its payload (the Trajectory,
:func:`streamrl.common.payload_format.unpack_payload`; renamed under the batch: ``batched:{batch}:{trajectory id}``);
the learner reads the payloads and assembles each ScoredTrajectory
(:func:`streamrl.common.payloads.assemble`). A ref without a scored record names a hash field holding a whole
ScoredTrajectory (the first form of the contract, still read). The reads are bounded: :func:`plan_reads`
(pure, :mod:`streamrl.common.payloads`) splits the samples, in order, into reads whose payloads add up to at
most ``max_reply_bytes`` (``redis.max_command_mb``); a sample bigger than that alone is read on its own (it
is bounded by ``redis.max_message_mb`` when written). A read is one pipeline of ``GET`` (and ``HMGET``), so
no single reply is above the budget. Reads run one after another: the learner's memory
holds the batch, Redis's output buffer one read. The learner runs them for batch ``k + 1`` while batch ``k``
trains (:mod:`streamrl.learner.rl.prefetch`).

A manifest published split (:attr:`BatchManifest.parts`, :func:`split_refs`) is read first
(:func:`load_manifest`, in the same bounded reads): its parts, checked to be this batch's, in order, as many
refs as the header's samples, make the whole manifest. A part missing is a missing payload (below); a part
that is not this batch's is poison.

With lanes (:mod:`streamrl.common.lanes`) a joined manifest names payloads in several Redis servers: every
read takes ``redis`` as a :class:`~streamrl.common.lanes.LaneClients` too (a plain client is the home alone),
and each bounded read is routed by key - one pipeline per client holding some of its keys (:func:`route`,
pure), run side by side, the replies put back in the read's order. A key is a batch's own
(:func:`owned_buffers`) under that batch's prefix in the home or in any lane of the run.

A payload missing (its buffer deleted: the batch was counted dead, or Redis lost it) is
:class:`MissingPayloadError` naming the batch, how many samples are missing and the first one: a
batch is trained whole or not at all.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.lanes import LaneClients, lane_names
from streamrl.common.messages import (
    BatchManifest,
    ManifestPart,
    SampleRef,
    ScoredTrajectory,
    TrainingBatch,
)
from streamrl.common.payload_format import unpack_payload
from streamrl.common.payloads import assemble
from streamrl.common.payloads import plan_reads as plan_reads
from streamrl.common.streams import StreamNames


def owned_buffers(names: StreamNames, batch_id: str, keys: Iterable[str], lanes: int = 1) -> list[str]:
    """Those of ``keys`` that hold samples of batch ``batch_id`` (named under it,
    :meth:`StreamNames.batched_samples`, in ``names`` or, in a run of ``lanes`` > 1 lanes, in any lane's
    names): the only ones a service deletes for that batch, whatever else a manifest (a conflicting or forged
    copy) names."""
    spaces = [names, *(lane_names(names.run_id, k) for k in range(lanes if lanes > 1 else 0))]
    prefixes = tuple(n.batched_samples(batch_id, "") for n in spaces)
    return [k for k in keys if k.startswith(prefixes)]


GLOB_SPECIALS = re.compile(r"([*?\[\]\\])")


async def batch_keys(redis: Any, names: StreamNames, batch_id: str) -> list[str]:
    """Every key still under batch ``batch_id``'s prefix in ``names`` (:meth:`StreamNames.batched_samples`): its
    payloads and manifest parts, found by ``SCAN`` (all of a run's or lane's keys share one hash tag: one node).
    What deletes the payloads of a batch whose manifest part was lost - no entry names them any more."""
    prefix = GLOB_SPECIALS.sub(r"\\\1", names.batched_samples(batch_id, ""))
    return [k.decode() if isinstance(k, bytes) else k async for k in redis.scan_iter(match=f"{prefix}*", count=1000)]


def lane_clients(redis: Any) -> LaneClients:
    """``redis`` as the clients of a run's home and lanes: a :class:`LaneClients` as it is, a plain client as the
    home alone (a run without lanes: every key on it)."""
    return redis if isinstance(redis, LaneClients) else LaneClients(redis, [])


def route(clients: LaneClients, keys: Sequence[str]) -> list[tuple[Any, list[int]]]:
    """The positions of ``keys`` grouped by the client holding each (by its hash tag, :meth:`LaneClients.for_key`),
    each group in order, the groups in the order of their first key (pure)."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, key in enumerate(keys):
        client = clients.for_key(key)
        groups.setdefault(id(client), (client, []))[1].append(i)
    return list(groups.values())


async def _get_routed(
    clients: LaneClients, keys: Sequence[str], sizes: Sequence[int], *, max_reply_bytes: int
) -> list[bytes | None]:
    """The values of ``keys`` (None: missing), in order, read in bounded reads (:func:`plan_reads`), each one
    pipeline of ``GET`` per client holding some of its keys, run side by side."""
    out: list[bytes | None] = [None] * len(keys)
    for read in plan_reads(list(sizes), max_reply_bytes):

        async def get(client: Any, positions: list[int]) -> list[tuple[int, bytes | None]]:
            pipe = client.pipeline(transaction=False)
            for i in positions:
                pipe.get(keys[i])
            return list(zip(positions, await pipe.execute(), strict=True))

        groups = route(clients, [keys[i] for i in read])
        replies = await asyncio.gather(*(get(c, [read[j] for j in group]) for c, group in groups))
        for i, value in (pair for reply in replies for pair in reply):
            out[i] = value or None
    return out


class MissingPayloadError(Exception):
    """A sample a manifest names is not in Redis (any more): the batch cannot be trained whole."""


def split_refs(refs: Sequence[SampleRef], max_bytes: int) -> list[list[SampleRef]]:
    """``refs`` in consecutive runs whose encodings add up to at most ``max_bytes`` each (one bigger ref alone),
    in order (pure): the parts of a split manifest; one run when they all fit."""
    sizes = [len(msgspec.msgpack.encode(r)) for r in refs]
    return [[refs[i] for i in run] for run in plan_reads(sizes, max_bytes)]


async def load_manifest(redis: Any, manifest: BatchManifest, *, max_reply_bytes: int) -> BatchManifest:
    """``manifest`` whole: a split one with its parts' refs as its samples (read in bounded replies, each part
    from the client holding it: ``redis`` a client or a :class:`LaneClients`), any other as it is. MissingPayloadError when a part is gone; PoisonMessageError when a part is not this batch's (its
    id, its number) or the refs do not number the header's samples."""
    if not manifest.parts or manifest.samples:  # whole, or read already
        return manifest
    if len(manifest.part_bytes) != len(manifest.parts):
        raise PoisonMessageError(
            f"{manifest.id}: {len(manifest.parts)} parts but {len(manifest.part_bytes)} part sizes: one each"
        )
    values = await _get_routed(
        lane_clients(redis), manifest.parts, manifest.part_bytes, max_reply_bytes=max_reply_bytes
    )
    missing = [key for key, value in zip(manifest.parts, values, strict=True) if value is None]
    if missing:
        raise MissingPayloadError(
            f"{manifest.id}: {len(missing)} of its {len(manifest.parts)} manifest parts missing in Redis (first: "
            f"{missing[0]}): deleted (the batch was counted dead?) or lost; it cannot be trained whole"
        )
    refs: list[SampleRef] = []
    for number, value in enumerate(v for v in values if v is not None):  # all of them (checked above)
        part = decode(value, ManifestPart)
        if (part.batch_id, part.number) != (manifest.id, number):
            raise PoisonMessageError(
                f"{manifest.id}: its part {number} ({manifest.parts[number]}) holds part {part.number} of "
                f"{part.batch_id}"
            )
        refs += part.samples
    if len(refs) != len(manifest.staleness):
        raise PoisonMessageError(
            f"{manifest.id}: its parts name {len(refs)} samples, its header {len(manifest.staleness)}"
        )
    return msgspec.structs.replace(manifest, samples=refs)


def resolve(manifest: BatchManifest, samples: list[ScoredTrajectory]) -> TrainingBatch:
    """The TrainingBatch ``manifest`` names, from its samples' payloads (in the manifest's order; each sample
    given the manifest's trace context for it, in place)."""
    if len(samples) != len(manifest.samples):  # a check that must hold under python -O too
        raise ValueError(f"batch {manifest.id}: {len(samples)} payloads for {len(manifest.samples)} references")
    for ref, sample in zip(manifest.samples, samples, strict=True):
        if ref.traceparent:
            sample.traceparent = ref.traceparent
    return TrainingBatch(
        id=manifest.id,
        index=manifest.index,
        samples=samples,
        policy_version=manifest.policy_version,
        staleness=manifest.staleness,
        created_at=manifest.created_at,
        traceparent=manifest.traceparent,
    )


def manifest_of(batch: TrainingBatch, keys: Sequence[str], sizes: Sequence[int]) -> BatchManifest:
    """The manifest of ``batch`` whose samples are stored in the hashes ``keys`` (under their trajectory ids),
    ``sizes`` bytes each (encoded)."""
    if not len(keys) == len(sizes) == len(batch.samples):
        raise ValueError(
            f"{batch.id}: {len(batch.samples)} samples but {len(keys)} keys and {len(sizes)} sizes: one of each per sample"
        )
    refs = [
        SampleRef(
            trajectory_id=s.trajectory.id,
            group_id=s.trajectory.group_id,
            key=key,
            field=s.trajectory.id,
            policy_version_start=s.trajectory.policy_version_start,
            num_bytes=size,
            traceparent=s.traceparent,
        )
        for s, key, size in zip(batch.samples, keys, sizes, strict=True)
    ]
    return BatchManifest(
        id=batch.id,
        index=batch.index,
        samples=refs,
        policy_version=batch.policy_version,
        staleness=batch.staleness,
        created_at=batch.created_at,
        traceparent=batch.traceparent,
    )


async def _read_routed(clients: LaneClients, refs: Sequence[SampleRef]) -> list[bytes | None]:
    """The payloads of ``refs``, in order (None: missing): :func:`_read` on each client holding some of them,
    side by side."""
    groups = route(clients, [r.key for r in refs])
    replies = await asyncio.gather(*(_read(client, [refs[i] for i in group]) for client, group in groups))
    out: list[bytes | None] = [None] * len(refs)
    for (_, group), values in zip(groups, replies, strict=True):
        for i, value in zip(group, values, strict=True):
            out[i] = value
    return out


async def _read(redis: Any, refs: Sequence[SampleRef]) -> list[bytes | None]:
    """The payloads of ``refs``, in order (None: missing), in one pipeline: a GET per payload string (a ref with
    its scored record), one HMGET per hash of whole ScoredTrajectories (the first form)."""
    by_key: dict[str, list[int]] = {}
    strings: list[int] = []
    for i, ref in enumerate(refs):
        if ref.scored is not None:
            strings.append(i)
        else:
            by_key.setdefault(ref.key, []).append(i)
    pipe = redis.pipeline(transaction=False)
    for i in strings:
        pipe.get(refs[i].key)
    for key, positions in by_key.items():
        pipe.hmget(key, [refs[i].field for i in positions])
    replies = await pipe.execute()
    out: list[bytes | None] = [None] * len(refs)
    for i, value in zip(strings, replies[: len(strings)], strict=True):
        out[i] = value
    for positions, values in zip(by_key.values(), replies[len(strings) :], strict=True):
        for i, value in zip(positions, values, strict=True):
            out[i] = value
    return out


def _decode_all(refs: Sequence[SampleRef], payloads: list[bytes]) -> list[ScoredTrajectory]:
    out = []
    for ref, payload in zip(refs, payloads, strict=True):
        if ref.scored is None:
            out.append(decode(payload, ScoredTrajectory))
            continue
        try:
            out.append(assemble(ref.scored, unpack_payload(payload)))
        except ValueError as e:
            raise PoisonMessageError(str(e)) from e
    return out


async def fetch_samples(redis: Any, manifest: BatchManifest, *, max_reply_bytes: int) -> list[ScoredTrajectory]:
    """Every sample ``manifest`` names, read in bounded replies (see the module docstring) and decoded off the
    event loop; ``redis``: a client or a :class:`LaneClients` (each payload read from the Redis of its key's lane).
    MissingPayloadError when one is gone; PoisonMessageError when one is not a ScoredTrajectory."""
    clients = lane_clients(redis)
    refs = manifest.samples
    samples: list[ScoredTrajectory] = []
    for read in plan_reads([r.num_bytes for r in refs], max_reply_bytes):
        chunk = [refs[i] for i in read]
        payloads = await _read_routed(clients, chunk)
        missing = [ref for ref, p in zip(chunk, payloads, strict=True) if p is None]
        if missing:
            first = missing[0]
            raise MissingPayloadError(
                f"{manifest.id}: payloads missing in Redis ({len(missing)} of the {len(chunk)} samples of one read; "
                f"first: {first.trajectory_id} in {first.key}): deleted (the batch was counted dead?) or lost; "
                "it cannot be trained whole"
            )
        samples += await asyncio.to_thread(_decode_all, chunk, [p for p in payloads if p is not None])
    return samples


async def fetch_batch(redis: Any, manifest: BatchManifest, *, max_reply_bytes: int) -> TrainingBatch:
    """The TrainingBatch ``manifest`` names: its parts read if it is split (:func:`load_manifest`), then its
    payloads (:func:`fetch_samples`)."""
    whole = await load_manifest(redis, manifest, max_reply_bytes=max_reply_bytes)
    return resolve(whole, await fetch_samples(redis, whole, max_reply_bytes=max_reply_bytes))
