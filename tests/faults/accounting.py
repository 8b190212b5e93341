"""The counting invariants of a finished run, read from its streams and state keys only.

The streams' entries are what the run's :class:`tap.StreamTap` saw written (streams are trimmed once
consumed: Redis no longer holds them at the end); without a tap, what Redis holds (XRANGE). State
keys, pending lists and the coordinator's in-flight set are read from Redis at the end.

* **issued**: training prompt groups on ``prompts`` (PromptWorkItem, not evaluation), less what the
  scenario wrote itself.
* **trained**: groups whose samples are in a batch the learner trained. The trained batches are
  the ``batch_id`` of every WeightsPublished signed with the run's key, along the learner's
  surviving history (an event without a batch is a learner (re)start serving its checkpoint's
  ``step``: steps after that checkpoint published by the previous life were rolled back and are
  trained again; an event for a step already in the history, the restarted learner publishing its
  last pre-restart version again, replaces it and the steps after it), less the batches the learner consumed untrained (its dead letter says
  ``BATCH_SKIPPED``; their version is published with unchanged weights).
* **dropped, with a reason**: groups named by a dead letter (a prompt, one of its trajectories or
  scored trajectories, or a training batch holding it, dead-lettered by the learner), by the
  dead letter's stream and error type; and the coordinator's drop counters, which name no group:
  ``state:groups_filtered`` (dynamic filtering), ``state:samples_too_stale`` / group size
  (staleness), and any ``state:groups_timed_out``-like counter (group timeout).
* **lost** = issued groups neither trained nor named by a dead letter, beyond what the counters
  account for. **over-counted** = counters beyond those groups (a group with two fates).
* **trained twice**: trajectory ids that occur more than once in the trained batches.
* **pending at end**: XPENDING of every consumer group of every stream of the run, plus the
  coordinator's in-flight set.
* **versions reused**: policy versions published with two different checksums (other weights under
  a number rollout workers already hold), except the newest version published again by a restarted
  learner (its retrained weights; workers reload a version whose checksum changed).
* **steps**: the policy version reached (coordinator's ``state:policy_version``, and the last
  signed event's version).
* **recovery**: seconds from the end of the fault (a restart, a healed network) to the next trained
  batch (``published_at`` of the next WeightsPublished with a batch).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis as syncredis

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import (
    BATCH_SKIPPED,
    BatchManifest,
    DeadLetter,
    PromptWorkItem,
    ScoredRecord,
    ScoredTrajectory,
    TrainingBatch,
    Trajectory,
    TrajectoryRecord,
    WeightsPublished,
)
from streamrl.common.streams import StreamNames
from streamrl.common.weights.auth import check

ERROR_TYPE = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b")
TIMEOUT_COUNTER = re.compile(r"groups?_(timed_out|timeouts?|expired)$")
"""State counters of groups given up on by the coordinator's group timeout."""


@dataclass
class Counts:
    """What :func:`count_run` found; one row of the fault table."""

    issued: int = 0
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Reason -> groups."""
    lost: int = 0
    over_counted: int = 0
    trained_twice: int = 0
    versions_reused: int = 0
    pending_end: int = 0
    steps: int = 0
    eval_rounds_open: int = 0
    trajectories: dict[str, int] = field(default_factory=dict)
    """generated / scored / trained (training trajectories, unique ids)."""
    dead_letters: int = 0
    recovery_s: float | None = None
    notes: list[str] = field(default_factory=list)
    """Where the lost, pending or twice-trained items are (for failure messages)."""


Entries = Callable[[str], list[tuple[str, bytes]]]
"""``entries(stream)``: every entry written to ``stream`` as (id, payload), in order."""


def redis_entries(client: syncredis.Redis) -> Entries:
    """The entries Redis still holds (XRANGE): complete only where nothing was trimmed."""

    def entries(stream: str) -> list[tuple[str, bytes]]:
        return [(eid.decode(), fields.get(b"d", b"")) for eid, fields in client.xrange(stream)]

    return entries


def _decode(payload: bytes) -> Any:
    try:
        return decode(payload)
    except PoisonMessageError:
        return None


Batch = TrainingBatch | BatchManifest
"""A batch on ``batches``: the manifest the coordinator publishes (the samples by reference), or a whole batch."""


def batch_members(batch: Batch) -> list[tuple[str, str]]:
    """(trajectory id, group id) of each training sample of ``batch`` (a manifest names them without payloads;
    evaluation samples are never batched, and a whole batch's are left out)."""
    if isinstance(batch, BatchManifest):
        return [(s.trajectory_id, s.group_id) for s in batch.samples]
    return [(s.trajectory.id, s.trajectory.group_id) for s in batch.samples if not s.trajectory.is_eval]


def _batch_groups(batch: Batch) -> set[str]:
    return {group for _, group in batch_members(batch)}


def _dead_groups(letter: DeadLetter) -> tuple[set[str], bool]:
    """Training groups a dead letter names, and whether it is an evaluation item."""
    inner = _decode(letter.payload)
    if isinstance(inner, PromptWorkItem):
        return (set() if inner.is_eval else {inner.id}), inner.is_eval
    if isinstance(inner, Trajectory | TrajectoryRecord):
        return (set() if inner.is_eval else {inner.group_id}), inner.is_eval
    if isinstance(inner, ScoredTrajectory | ScoredRecord):
        t = inner.trajectory
        return (set() if t.is_eval else {t.group_id}), t.is_eval
    if isinstance(inner, TrainingBatch | BatchManifest):
        return _batch_groups(inner), False
    return set(), False


def trained_history(events: list[WeightsPublished]) -> list[str]:
    """Batch ids trained along the learner's surviving history (see the module docstring)."""
    history: list[tuple[int, str]] = []
    for ev in events:
        if not ev.batch_id:
            history = [(step, b) for step, b in history if step <= ev.step]
        else:
            history = [(step, b) for step, b in history if step < ev.step] + [(ev.step, ev.batch_id)]
    return [b for _, b in history]


@dataclass(frozen=True)
class Lane:
    """One lane of a run with lanes (:mod:`streamrl.common.lanes`): its Redis and key names."""

    client: syncredis.Redis
    names: StreamNames


def count_run(
    client: syncredis.Redis,
    names: StreamNames,
    *,
    group_size: int,
    weights_key: str,
    injected: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
    fault_end: float | None = None,
    entries: Entries | None = None,
    lanes: tuple[Lane, ...] = (),
) -> Counts:
    """Count a finished run (see the module docstring); ``entries`` is the tap's
    :meth:`tap.StreamTap.entries` (default: what Redis holds), for every stream of the run and its lanes.

    With ``lanes`` (a run with several lanes), ``client`` / ``names`` are the home's - the learner's ``weights`` and
    the joined ``batches`` -, and prompts, trajectories, scored trajectories, the coordinators' counters, the
    in-flight sets and evaluation rounds are each lane's; dead letters and pending entries are counted everywhere.
    """
    c = Counts()
    read = entries or redis_entries(client)
    pipelines = lanes or (Lane(client, names),)
    everywhere = (Lane(client, names), *lanes) if lanes else pipelines

    issued: set[str] = set()
    for lane in pipelines:
        for eid, payload in read(lane.names.prompts):
            msg = _decode(payload)
            if isinstance(msg, PromptWorkItem) and not msg.is_eval and (lane.names.prompts, eid) not in injected:
                issued.add(msg.id)
    c.issued = len(issued)

    events: list[WeightsPublished] = []
    for eid, payload in read(names.weights):
        msg = _decode(payload)
        if isinstance(msg, WeightsPublished) and (names.weights, eid) not in injected:
            try:
                check(msg, weights_key.encode(), run_id=names.run_id)
            except PoisonMessageError:
                continue
            events.append(msg)
    batches: dict[str, Batch] = {}
    for eid, payload in read(names.batches):
        msg = _decode(payload)
        if isinstance(msg, TrainingBatch | BatchManifest) and (names.batches, eid) not in injected:
            if msg.id in batches and encode_ids(batches[msg.id]) != encode_ids(msg):
                c.notes.append(f"two different batches named {msg.id}")
            batches.setdefault(msg.id, msg)

    checksums: dict[int, set[str]] = {}
    reused_set: set[int] = set()
    newest = -1
    for ev in events:
        if ev.version in checksums and ev.checksum not in checksums[ev.version] and ev.version != newest:
            reused_set.add(ev.version)  # other weights under an older version: not the restart's republish
        checksums.setdefault(ev.version, set()).add(ev.checksum)
        newest = max(newest, ev.version)
    republished = sorted(v for v, sums in checksums.items() if len(sums) > 1 and v not in reused_set)
    if republished:
        c.notes.append(f"versions published again by a restarted learner: {republished[:8]}")
    reused = sorted(reused_set)
    c.versions_reused = len(reused)
    if reused:
        c.notes.append(f"versions published with different weights: {reused[:8]}")
    learner_dead = _learner_dead_batches(read, names, injected)
    history = [b for b in trained_history(events) if b not in learner_dead]
    twice_batches = [b for b, n in Counter(history).items() if n > 1]
    if twice_batches:
        c.notes.append(f"batches trained twice: {twice_batches}")
    trained_ids: Counter[str] = Counter()
    trained_groups: set[str] = set()
    for batch_id in history:
        batch = batches.get(batch_id)
        if batch is None:
            c.notes.append(f"trained batch {batch_id} is not on the batches stream")
            continue
        trained_ids.update(t for t, _ in batch_members(batch))
        trained_groups |= _batch_groups(batch)
    twice = {t: n for t, n in trained_ids.items() if n > 1}
    c.trained_twice = sum(n - 1 for n in twice.values())
    if twice:
        c.notes.append(f"trajectories trained twice: {sorted(twice)[:8]}")
    strays = trained_groups - issued
    if strays:
        c.notes.append(f"trained groups never issued by the coordinator: {sorted(strays)[:8]}")
    c.trained = len(trained_groups & issued)

    dropped: Counter[str] = Counter()
    named_dead: set[str] = set()
    for _, payload in (p for lane in everywhere for p in read(lane.names.dead)):
        letter = _decode(payload)
        if not isinstance(letter, DeadLetter) or (letter.stream, letter.entry_id) in injected:
            continue  # the scenario's own poison entries are not the run's work
        c.dead_letters += 1
        groups, _ = _dead_groups(letter)
        reason = f"dead {letter.stream.rsplit(':', 1)[-1]}: {error_kind(letter.error)}"
        for g in (groups & issued) - trained_groups - named_dead:
            dropped[reason] += 1
            named_dead.add(g)
    unexplained = issued - trained_groups - named_dead

    counters: Counter[str] = Counter()
    for lane in pipelines:
        for key in lane.client.scan_iter(match=lane.names.state("*")):
            name = key.decode().rsplit(":", 1)[-1]
            if name == "groups_filtered" or TIMEOUT_COUNTER.match(name):
                counters[name] += int(lane.client.get(key) or 0)
            elif name == "samples_too_stale":
                counters["too stale"] += int(lane.client.get(key) or 0) // group_size
    for name, n in counters.items():
        if n:
            dropped[name] += n
    c.dropped = dict(dropped)
    accounted = sum(counters.values())
    c.lost = max(0, len(unexplained) - accounted)
    c.over_counted = max(0, accounted - len(unexplained))
    if c.lost:
        inflight = {g.decode() for lane in pipelines for g in lane.client.smembers(lane.names.state("inflight"))}
        ready = {g.decode() for lane in pipelines for g in lane.client.lrange(lane.names.state("ready"), 0, -1)}
        c.notes.append(
            f"{len(unexplained)} groups neither trained nor dead-lettered, {accounted} counted by the coordinator "
            f"({counters}); of them {len(unexplained & inflight)} still in flight, {len(unexplained & ready)} "
            f"complete but never batched: {sorted(unexplained)[:10]}"
        )

    generated = {
        m.id
        for lane in pipelines
        for _, p in read(lane.names.trajectories)
        if isinstance(m := _decode(p), Trajectory | TrajectoryRecord) and not m.is_eval
    }
    scored = {
        m.trajectory.id
        for lane in pipelines
        for _, p in read(lane.names.scored)
        if isinstance(m := _decode(p), ScoredTrajectory | ScoredRecord) and not m.trajectory.is_eval
    }
    c.trajectories = {"generated": len(generated), "scored": len(scored), "trained": sum(trained_ids.values())}

    c.pending_end = sum(_pending(lane.client, lane.names, c.notes) for lane in everywhere)
    raw_versions = [lane.client.get(lane.names.state("policy_version")) for lane in pipelines]
    c.steps = max(min(int(raw or 0) for raw in raw_versions), max((e.version for e in events), default=0))
    rounds = {
        k.decode(): v.decode()
        for lane in pipelines
        for k, v in lane.client.hgetall(lane.names.state("eval_rounds")).items()
    }
    c.eval_rounds_open = sum(1 for v in rounds.values() if v.startswith("started"))
    if c.eval_rounds_open:
        c.notes.append(
            f"evaluation rounds never closed: {sorted(k for k, v in rounds.items() if v.startswith('started'))}"
        )

    if fault_end is not None:
        after = [e.published_at for e in events if e.batch_id and e.published_at >= fault_end]
        c.recovery_s = round(min(after) - fault_end, 1) if after else None
    return c


def error_kind(error: str) -> str:
    """The exception type a dead letter's reason names (``ScorerError``, ``FloatingPointError``...)."""
    match = ERROR_TYPE.search(error)
    return match.group(0) if match else error[:40]


def _learner_dead_batches(read: Entries, names: StreamNames, injected: set[tuple[str, str]]) -> set[str]:
    """Ids of the batches the learner consumed untrained (its dead letter says ``BATCH_SKIPPED``). A letter
    for a copy of a trained batch, or one from the future, does not make a trained batch untrained."""
    out = set()
    for _, payload in read(names.dead):
        letter = _decode(payload)
        if not isinstance(letter, DeadLetter) or (letter.stream, letter.entry_id) in injected:
            continue
        inner = _decode(letter.payload)
        if (
            letter.stream == names.batches
            and BATCH_SKIPPED in letter.error
            and isinstance(inner, TrainingBatch | BatchManifest)
        ):
            out.add(inner.id)
    return out


def encode_ids(batch: Batch) -> list[str]:
    return [t for t, _ in batch_members(batch)]


def _pending(client: syncredis.Redis, names: StreamNames, notes: list[str]) -> int:
    total = 0
    for stream in (names.prompts, names.trajectories, names.scored, names.batches, names.weights, names.dead):
        if not client.exists(stream):
            continue
        for group in client.xinfo_groups(stream):
            if group["pending"]:
                total += int(group["pending"])
                notes.append(f"{group['pending']} pending on {stream.rsplit(':', 1)[-1]} for {group['name'].decode()}")
    inflight = client.scard(names.state("inflight"))
    if inflight:
        notes.append(f"{inflight} groups still in the coordinator's in-flight set")
    return total + int(inflight)
