"""Poison entries in every stream mid-run (the kinds of tests/faults/poison.py): each one a consumer
group reads is dead-lettered with a reason naming its defect, the followed streams' readers pass
over theirs, no out-of-order batch is trained, a forged letter about the newest batch deletes nothing (it is
counted as forged and the batch is trained), and the run goes on to the end with nothing lost.

``redis.max_message_mb = 1`` so that an oversized entry is 1.5 MiB, not 33.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TypeVar

import pytest
from harness import FaultRun, MakeRun
from poison import (
    FORGED_LETTER_ENTRY,
    Poison,
    first_message,
    forged_batch_letter,
    forged_weights,
    malformed,
    out_of_order_batches,
)
from scenario import conclude

from streamrl.common.codec import decode, encode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import (
    BatchManifest,
    DeadLetter,
    PromptWorkItem,
    ScoredRecord,
    TrajectoryRecord,
    WeightsPublished,
)

pytestmark = pytest.mark.slow
T = TypeVar("T")
TOTAL_STEPS = 12
INJECT_AT_VERSION = 3
RECOVERY_BOUND_S = 20.0
"""Poison must not stop the run: from the injection to the next trained batch (s)."""


def _write(run: FaultRun, stream: str, poisons: list[Poison]) -> list[tuple[str, str, Poison]]:
    written = []
    for p in poisons:
        entry_id = run.client.xadd(stream, {b"d": p.payload}).decode()
        run.injected.add((stream, entry_id))
        written.append((stream, entry_id, p))
    return written


def _dead_letter_failures(run: FaultRun, written: list[tuple[str, str, Poison]]) -> list[str]:
    letters: dict[tuple[str, str], str] = {}
    for _, fields in run.written(run.names.dead):
        try:
            letter = decode(fields.get(b"d", b""), DeadLetter)
        except PoisonMessageError:
            continue
        letters[(letter.stream, letter.entry_id)] = letter.error
    failures = []
    for stream, entry_id, p in written:
        short = stream.rsplit(":", 1)[-1]
        if p.reason is None:
            continue
        error = letters.get((stream, entry_id))
        if error is None:
            failures.append(f"{p.kind} entry on {short} was not dead-lettered")
        elif p.reason not in error:
            failures.append(f"{p.kind} entry on {short} dead-lettered with {error[:120]!r} (want {p.reason!r})")
    return failures


def _decoded(run: FaultRun, stream: str, kind: type[T]) -> list[T]:
    """The entries of ``stream`` that decode as ``kind`` (the poison among them left out)."""
    out = []
    for _, fields in run.written(stream):
        try:
            out.append(decode(fields.get(b"d", b""), kind))
        except PoisonMessageError:
            continue
    return out


def test_poison_in_every_stream(fault_run: MakeRun) -> None:
    run: FaultRun = fault_run("poison", [f"--total_steps={TOTAL_STEPS}", "--redis.max_message_mb=1"]).start()
    run.wait_version(INJECT_AT_VERSION)
    n, client = run.names, run.client
    prompt, _ = first_message(run.written(n.prompts), PromptWorkItem)
    traj, _ = first_message(run.written(n.trajectories), TrajectoryRecord)  # the records the pipeline commits
    scored, _ = first_message(run.written(n.scored), ScoredRecord)
    batch, _ = first_message(run.written(n.batches), BatchManifest)  # batch-0: trained by now
    weights, _ = first_message(run.written(n.weights), WeightsPublished)
    letter = DeadLetter(
        stream=n.trajectories,
        entry_id="0-1",
        group="reward",
        consumer="faults",
        error="template",
        deliveries=1,
        payload=b"",
        ts=time.time(),
    )
    written = []
    written += _write(run, n.prompts, malformed(prompt))
    written += _write(run, n.trajectories, malformed(traj))
    written += _write(run, n.scored, malformed(scored))
    # the learner reads batches of any size (a batch is many trajectories, each under the limit): its
    # oversized entry is one from the future, which must be dead-lettered either way
    written += _write(run, n.batches, malformed(batch, oversized=False) + out_of_order_batches(batch))
    # followed streams: no consumer group, so no dead letter; the readers must skip them and go on
    written += _write(run, n.weights, [replace(p, reason=None) for p in malformed(weights)])
    written += _write(run, n.weights, [forged_weights(weights)])
    written += _write(run, n.dead, [replace(p, reason=None) for p in malformed(letter)])
    manifests = _decoded(run, n.batches, BatchManifest)
    victim = max((m for m in manifests if m.index < 1000), key=lambda m: m.index)  # the newest: not trained yet
    run.injected.add((n.batches, FORGED_LETTER_ENTRY))
    client.xadd(n.dead, {b"d": encode(forged_batch_letter(victim, n.batches))})
    run.details.update(forged_letter_victim=victim.id, version_at_forgery=run.version())
    injected_at = time.time()

    def checks() -> list[str]:
        failures = _dead_letter_failures(run, written)
        version = int(client.get(n.state("policy_version")) or 0)
        if version > TOTAL_STEPS:
            failures.append(f"the coordinator's policy version is {version}: a forged weights event moved it")
        forged = int(client.get(n.state("dead_letters_forged")) or 0)
        if forged != 1:
            failures.append(f"the coordinator counted {forged} forged dead letters, not 1")
        trained = {event.batch_id for event in _decoded(run, n.weights, WeightsPublished)}
        if victim.id not in trained:
            failures.append(f"{victim.id}, named by a forged letter, was never trained")
        return failures

    conclude(
        run,
        "poison in every stream",
        total_steps=TOTAL_STEPS,
        fault_end=injected_at,
        recovery_bound_s=RECOVERY_BOUND_S,
        checks=checks,
    )
