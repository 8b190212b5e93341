"""Weight chunks corrupted and cut short in transit: refused by their digest, fetched again, never served.

The rollout worker fetches each version from the learner's weight server (the default ZMQ transport:
its manifest over ZMQ, its chunks over the raw TCP chunk port) through tests/faults/weights_proxy.py,
which tampers with one chunk transfer of three fetches: it flips a byte of a chunk of version 3,
closes the connection half-way through a chunk of version 5, and flips a byte of a chunk of version 7
(or of the next version fetched, should the worker skip one). The streaming receiver checks every
chunk against the manifest's digest (bound by the signed event's checksum), so each tampered chunk
is refused loudly and fetched again alone on a new connection (``stream.CHUNK_TRIES``); nothing of the
version reaches the engine before every chunk verified, and the run finishes with nothing lost.

What the row checks that the counting does not: every tampered transfer is refused by name in the
worker's log - a digest failure or a chunk cut short, naming that version, bucket and chunk -
exactly once per tampering (a corrupted chunk that got through would leave one missing); the tampered
chunk was requested again (a refetch) unless a newer version took over; and the worker served a
tampered version only after its refusal, and only versions the learner published and signed.
"""

from __future__ import annotations

import re

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude
from weights_proxy import LISTEN_HOST, WeightsProxy, free_port_pair

from streamrl.common.codec import decode
from streamrl.common.messages import WeightsPublished

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
FAULTS = {3: "corrupt", 5: "truncate", 7: "corrupt"}
RECOVERY_BOUND_S = 20.0
"""From the last tampered transfer to the next trained batch (s): one retry pause plus a fetch."""
FAILED = re.compile(
    r"weight sync (?:to|of) version (\d+) (?:failed|from \S+: bucket \d+ chunk \d+ .*fetching it again)"
)
"""A version's fetch failed, or one chunk of it was refused and fetched again (the receiver's per-chunk retry)."""
SERVING = re.compile(r"now serving policy version (\d+)")


def test_weight_chunks_corrupted_and_truncated(fault_run: MakeRun) -> None:
    port = free_port_pair()
    proxy = WeightsProxy(port, chunk_faults=FAULTS).start()
    overrides = [
        f"--total_steps={TOTAL_STEPS}",
        f"--learner.weights_port={port}",
        f"--learner.weights_advertise_host={LISTEN_HOST}",
    ]
    try:
        run: FaultRun = fault_run("weights-chunk-corrupt", overrides).start()
        run.wait_until("every chunk fault used", lambda: not proxy.chunk_faults, 120.0)
        last_fault = proxy.tampered[-1].at

        def checks() -> list[str]:
            lines = (run.workdir / "logs" / "rollout-0.log").read_text(errors="replace").splitlines()
            published = {decode(payload, WeightsPublished).version for _, payload in run.entries(run.names.weights)}
            return _refused_refetched_never_served(proxy, lines, published)

        run.details["tampered"] = [f"{t.kind} v{t.version} b{t.bucket} c{t.chunk}" for t in proxy.tampered]
        conclude(
            run,
            "weight chunks corrupted (2) and cut short (1)",
            total_steps=TOTAL_STEPS,
            fault_end=last_fault,
            recovery_bound_s=RECOVERY_BOUND_S,
            checks=checks,
        )
    finally:
        proxy.close()


def _refused_refetched_never_served(proxy: WeightsProxy, lines: list[str], published: set[int]) -> list[str]:
    """The row's own checks (see the module docstring), one line per failure."""
    failures = []
    if [t.kind for t in proxy.tampered] != list(FAULTS.values()):
        failures.append(f"tampered {[(t.kind, t.version) for t in proxy.tampered]}, meant {list(FAULTS.values())}")
    refusals = [(i, int(m.group(1)), line) for i, line in enumerate(lines) if (m := FAILED.search(line))]
    served = [(i, int(m.group(1))) for i, line in enumerate(lines) if (m := SERVING.search(line))]
    for t in proxy.tampered:
        if t.kind == "corrupt":
            named = f"bucket {t.bucket} chunk {t.chunk} failed its digest"
        else:
            named = f"bucket {t.bucket} chunk {t.chunk} was cut short"
        matching = [(i, line) for i, v, line in refusals if v == t.version and named in line]
        if len(matching) != 1:
            failures.append(f"{t.kind} of version {t.version}: {len(matching)} refusals naming {named!r} (want 1)")
            continue
        refused_at, line = matching[0]
        requests = proxy.chunk_requests[(t.version, t.bucket, t.chunk)]
        if requests <= t.requests_before and "a newer weights event is published" not in line:
            failures.append(
                f"{t.kind} of version {t.version}: neither fetched again nor superseded (requests of its chunk: "
                f"{t.requests_before} up to the fault, {requests} in all; of the version: "
                f"{sorted((k, n) for k, n in proxy.chunk_requests.items() if k[0] == t.version)})"
            )
        early = [i for i, v in served if v == t.version and i < refused_at]
        if early:
            failures.append(f"version {t.version} served before its tampered fetch was refused (log line {early[0]})")
    unsigned = sorted({v for _, v in served} - published)
    if unsigned:
        failures.append(f"served versions the learner never published: {unsigned}")
    tampered = {t.version for t in proxy.tampered}
    spoiled = (
        "failed its digest",
        "was cut short",
        "the server went away",
    )  # a refusal that is not "not served (current: ...)"
    unexpected = [line for _, v, line in refusals if v not in tampered and any(s in line for s in spoiled)]
    if unexpected:
        failures.append(f"{len(unexpected)} untampered fetches refused as spoiled, e.g. {unexpected[0][-200:]}")
    return failures
