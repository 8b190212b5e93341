"""Trajectory payloads: written once by the rollout worker, referenced by small records after.

A trajectory's payload (its encoded :class:`~streamrl.common.messages.Trajectory`: tokens, log-probs, text)
is SET once under its own key, :meth:`StreamNames.payload` ``(trajectory id, attempt)``, with plain pipelined
``SET key value NX PX ttl`` commands of at most ``redis.max_command_mb`` each call (:func:`write_payloads`),
*before* the worker's commit; the commit then carries only the :class:`TrajectoryRecord` (:func:`record_of`)
and PERSISTs the key it names (``Output(key=..., op="persist")``), atomically with the prompt's ack. So:

* no payload is ever a script argument, and Redis takes each payload in once;
* ``attempt`` is a random token of one delivery: a worker whose lease was taken over (or a retry) writes
  under another key, never over a payload another delivery committed;
* a payload no commit references (its worker died, was fenced, or its commit found the entry acked by
  another) keeps its time to live (``redis.payload_orphan_ttl_s``) and expires; ``NX`` keeps a re-sent SET
  from giving a committed payload a time to live again.

A payload is in two parts (payload format 2, :mod:`streamrl.common.payload_format`): a head with everything but
the tensors, then the tensors; the record carries the head's length (:attr:`TrajectoryRecord.payload_head_bytes`),
so the reward tier reads only the head (``GETRANGE``) unless a scorer reads token ids, and the learner reads the
whole string. Redis then sends a trajectory's tensors out once.

Readers fetch payloads in bounded pipelines of ``GET`` / ``GETRANGE`` (:func:`read_payloads`, planned by
:func:`plan_reads`): the reward tier to score, the learner to train
(:func:`assemble` rebuilds the ScoredTrajectory from the scored record and its payload). Who deletes a payload:
the coordinator, for the records it drops (evaluation samples once stored, filtered, failed, late and
too-stale groups: :data:`DROP_PAYLOADS_LUA` inside its scripts; batches counted dead); the learner, with the
checkpoint-covered ack of the batch that trained it (or it sets a time to live, ``redis.payload_retention_s``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from streamrl.common.bus import Output
from streamrl.common.errors import MessageTooLargeError
from streamrl.common.messages import (
    RECORD_METADATA_BYTES,
    ScoredRecord,
    ScoredTrajectory,
    Trajectory,
    TrajectoryRecord,
)
from streamrl.common.payload_format import pack_payload

if TYPE_CHECKING:
    from streamrl.common.bus import Bus
    from streamrl.common.streams import StreamNames

_SCALAR_TEXT_CHARS = 256

DROP_PAYLOADS_LUA = """
local function drop_payloads(hash, prefix)
  local n = 0
  for _, v in ipairs(redis.call('HVALS', hash)) do
    local ok, m = pcall(cmsgpack.unpack, v)
    if ok and type(m) == 'table' and type(m.trajectory) == 'table' then
      local key = m.trajectory.payload_key
      if type(key) == 'string' and string.sub(key, 1, #prefix) == prefix then
        n = n + redis.call('UNLINK', key)
      end
    end
  end
  return n
end
"""
"""A Lua function for the coordinator's scripts: ``drop_payloads(hash, prefix)`` deletes the payloads the
:class:`ScoredRecord` values of ``hash`` name - only keys under ``prefix`` (:attr:`StreamNames.payload_prefix`),
whatever a record says - and returns how many existed. Call it before deleting the hash."""


def small_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """What a record keeps of a trajectory's metadata (pure): all of it when it encodes to at most
    :data:`RECORD_METADATA_BYTES`, else its scalar entries (short strings, numbers, booleans, None)."""
    if len(msgspec.msgpack.encode(metadata)) <= RECORD_METADATA_BYTES:
        return dict(metadata)
    return {
        k: v
        for k, v in metadata.items()
        if v is None or isinstance(v, bool | int | float) or (isinstance(v, str) and len(v) <= _SCALAR_TEXT_CHARS)
    }


def record_of(trajectory: Trajectory, payload_key: str, payload_bytes: int, head_bytes: int = 0) -> TrajectoryRecord:
    """The record committed for ``trajectory``, whose payload (``payload_bytes`` long, its head the first
    ``head_bytes``; 0: format 1, :mod:`streamrl.common.payload_format`) is at ``payload_key``."""
    t = trajectory
    return TrajectoryRecord(
        id=t.id,
        group_id=t.group_id,
        group_index=t.group_index,
        group_size=t.group_size,
        payload_key=payload_key,
        payload_bytes=payload_bytes,
        payload_head_bytes=head_bytes,
        finish_reason=t.finish_reason,
        truncated=t.truncated,
        policy_version_start=t.policy_version_start,
        policy_version_end=t.policy_version_end,
        num_response_tokens=len(t.response_ids),
        num_loss_tokens=int(t.loss_mask.to_numpy().sum()),
        is_eval=t.is_eval,
        metadata=small_metadata(t.metadata),
        timings=dict(t.timings),
        traceparent=t.traceparent,
        stop_reason=t.stop_reason,
    )


def assemble(scored: ScoredRecord, payload: Trajectory) -> ScoredTrajectory:
    """The ScoredTrajectory a scored record and its payload make (the record's timings and trace context win:
    the coordinator may have added to them)."""
    if payload.id != scored.trajectory.id:
        raise ValueError(
            f"payload {scored.trajectory.payload_key} holds trajectory {payload.id}, not {scored.trajectory.id}"
        )
    trajectory = msgspec.structs.replace(
        payload, timings=dict(scored.trajectory.timings), traceparent=scored.trajectory.traceparent
    )
    return ScoredTrajectory(
        trajectory=trajectory,
        reward=scored.reward,
        score=scored.score,
        turn_rewards=scored.turn_rewards,
        extra=scored.extra,
        scorer=scored.scorer,
        reward_latency_ms=scored.reward_latency_ms,
        traceparent=scored.traceparent,
    )


def plan_reads(sizes: Sequence[int], max_bytes: int) -> list[range]:
    """Consecutive ranges of indices, each of sizes adding up to at most ``max_bytes`` (an item bigger than
    that alone in its range), covering every index once, in order (pure)."""
    if max_bytes < 1:
        raise ValueError(f"plan_reads: max_bytes must be at least 1, got {max_bytes}")
    reads: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > max_bytes:
            reads.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        reads.append(range(start, len(sizes)))
    return reads


async def write_payloads(
    redis: Any, items: Sequence[tuple[str, bytes]], *, ttl_s: float, max_command_bytes: int
) -> None:
    """SET each ``(key, payload)`` once (``NX``), with a time to live of ``ttl_s``, in pipelines of at most
    ``max_command_bytes`` of payloads each (one bigger payload alone)."""
    ttl_ms = max(1, int(ttl_s * 1000))
    for chunk in plan_reads([len(p) for _, p in items], max_command_bytes):
        pipe = redis.pipeline(transaction=False)
        for i in chunk:
            key, payload = items[i]
            pipe.set(key, payload, nx=True, px=ttl_ms)
        await pipe.execute()


async def read_payloads(
    redis: Any,
    keys: Sequence[str],
    sizes: Sequence[int],
    *,
    max_reply_bytes: int,
    prefixes: Sequence[int] | None = None,
) -> list[bytes | None]:
    """The values of ``keys`` (None: missing), in order, read in pipelines of GET whose replies add up to at
    most ``max_reply_bytes`` (``sizes``: the expected size of each). With ``prefixes``, a key whose prefix is
    positive is read only that far (``GETRANGE key 0 n-1``; its expected size is the prefix)."""
    lengths = list(prefixes) if prefixes is not None else [0] * len(keys)
    if len(lengths) != len(keys):
        raise ValueError(f"read_payloads: {len(keys)} keys but {len(lengths)} prefixes")
    out: list[bytes | None] = []
    for chunk in plan_reads([n or size for n, size in zip(lengths, sizes, strict=True)], max_reply_bytes):
        pipe = redis.pipeline(transaction=False)
        for i in chunk:
            if lengths[i] > 0:
                pipe.getrange(keys[i], 0, lengths[i] - 1)
            else:
                pipe.get(keys[i])
        # GETRANGE answers "" for a missing key (a payload is never empty)
        out += [value or None for value in await pipe.execute()]
    return out


async def store_payloads(bus: Bus, names: StreamNames, trajectories: Sequence[Trajectory]) -> list[Output]:
    """The rollout worker's half of a commit: write each trajectory's payload once (format 2, size-checked, plain
    pipelined SETs with ``redis.payload_orphan_ttl_s`` to live, under keys of this call's own ``attempt``), then
    return the outputs to commit with the prompt's ack: PERSIST of every payload first, then one small record each."""
    attempt = secrets.token_hex(6)
    encoded = [pack_payload(t) for t in trajectories]
    for t, (payload, _) in zip(trajectories, encoded, strict=True):
        if len(payload) > bus.max_message_bytes:
            raise MessageTooLargeError(
                f"the payload of trajectory {t.id}, {len(payload) / 2**20:.1f} MiB, is over the "
                f"{bus.max_message_bytes / 2**20:.1f} MiB limit (redis.max_message_mb)"
            )
    keys = [names.payload(t.id, attempt) for t in trajectories]
    items = [(key, payload) for key, (payload, _) in zip(keys, encoded, strict=True)]
    await write_payloads(bus.redis, items, ttl_s=bus.payload_orphan_ttl_s, max_command_bytes=bus.max_command_bytes)
    persist = [Output(key=key, op="persist") for key in keys]
    records = [
        Output(stream=names.trajectories, message=record_of(t, key, len(payload), head))
        for t, key, (payload, head) in zip(trajectories, keys, encoded, strict=True)
    ]
    return persist + records
