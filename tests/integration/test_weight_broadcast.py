"""The weight broadcast on gloo with real processes: one learner-side publisher, two receivers, a
third joining late, one killed in the middle of an update.

Each process is spawned and driven through a pipe. The publisher publishes versions 1..4 of a small
tied-embedding model (several buckets); the receivers report the version they have staged and the
checksum they recompute over their staging buffers. Every live receiver must end on the last
version with the publisher's checksum, the late joiner must get the current version before any new
publish, and the publisher must go on publishing while a member dies.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from streamrl.common.weights.broadcast import decode_rendezvous, encode

TIMEOUT_S = 3.0
"""The publisher's deadline: a dead member costs about this much before the group re-forms."""
BUCKET_BYTES = 64 * 1024


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """~0.2 MB of bf16 and fp32 tensors (several 64 KiB buckets), different for every version."""
    g = torch.Generator().manual_seed(version)
    named = [("model.embed_tokens.weight", torch.randn(300, 64, generator=g).to(torch.bfloat16))]
    for i in range(2):
        named += [
            (f"model.layers.{i}.self_attn.q_proj.weight", torch.randn(64, 64, generator=g).to(torch.bfloat16)),
            (f"model.layers.{i}.mlp.up_proj.weight", torch.randn(256, 64, generator=g).to(torch.bfloat16)),
            (f"model.layers.{i}.input_layernorm.weight", torch.randn(64, generator=g)),
        ]
    return named


def _publisher(conn: Connection) -> None:
    """("publish", v) -> (rendezvous bytes, checksum, seconds publish took); ("delivered", v, n) -> members."""
    from streamrl.torchkit.weights.broadcast import BroadcastPublisher

    publisher = BroadcastPublisher(bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S)
    while True:
        command, *args = conn.recv()
        if command == "stop":
            publisher.close()
            return
        if command == "publish":
            started = time.perf_counter()
            published = publisher.publish(_weights(args[0]), args[0])
            broadcast, checksum = published["broadcast"], published["checksum"]
            conn.send((encode(broadcast), checksum, time.perf_counter() - started))
        elif command == "delivered":
            conn.send(publisher.wait_delivered(args[0], timeout_s=30, min_members=args[1]))


def _receiver(conn: Connection, rendezvous: bytes, label: str, die_at: int) -> None:
    """("acquire", v) -> (staged version, checksum recomputed over the staging buffers, member id).

    With ``die_at`` > 0 the process kills itself (SIGKILL) after the first bucket of that version.
    """
    from streamrl.torchkit.weights.broadcast_member import BroadcastMember
    from streamrl.torchkit.weights.ipc import weights_checksum

    class DyingReceiver(BroadcastMember):
        def _receive(self, store: Any, generation: int, op: int, rank: int, group: Any, record: Any) -> None:
            if record.version == die_at:
                group = _KillAfterOneBucket(group)
            super()._receive(store, generation, op, rank, group, record)

    info = decode_rendezvous(rendezvous)
    receiver = DyingReceiver(info, torch.device("cpu"), label, timeout_s=30)
    conn.send(receiver.member)
    while True:
        command, *args = conn.recv()
        if command == "stop":
            receiver.close()
            return
        version, _ = receiver.acquire(args[0], timeout_s=30)
        try:
            conn.send((version, weights_checksum(receiver.staging, version, info.block_bytes)))
        finally:
            receiver.release()


class _KillAfterOneBucket:
    """A process group whose second broadcast kills the process: dead in the middle of an update."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.calls = 0

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.group.broadcast(tensors, options)

    def abort(self) -> None:
        self.group.abort()


class _Processes:
    def __init__(self) -> None:
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.procs: list[Any] = []

    def start(self, target: Any, *args: Any) -> tuple[Connection, Any]:
        conn, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        child.close()  # a dead child is then an EOFError here, not a hang
        self.procs.append(proc)
        return conn, proc


@pytest.fixture
def processes() -> Iterator[_Processes]:
    procs = _Processes()
    yield procs
    for proc in procs.procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def _ask(conn: Connection, *command: Any, timeout_s: float = 60) -> Any:
    conn.send(command)
    assert conn.poll(timeout_s), f"no answer to {command} within {timeout_s} s"
    return conn.recv()


def test_live_receivers_end_on_the_same_version_through_a_late_join_and_a_death(processes: _Processes) -> None:
    learner, _ = processes.start(_publisher)
    rendezvous, checksum_1, _ = _ask(learner, "publish", 1)
    a, _ = processes.start(_receiver, rendezvous, "a", 0)
    b, proc_b = processes.start(_receiver, rendezvous, "b", 3)
    member_a, member_b = a.recv(), b.recv()
    assert _ask(a, "acquire", 1) == (1, checksum_1)
    assert _ask(b, "acquire", 1) == (1, checksum_1)

    rendezvous, checksum_2, _ = _ask(learner, "publish", 2)
    assert _ask(a, "acquire", 2) == (2, checksum_2)
    assert _ask(b, "acquire", 2) == (2, checksum_2)

    # A late joiner gets the current version without a new publish.
    c, _ = processes.start(_receiver, rendezvous, "c", 0)
    member_c = c.recv()
    assert _ask(c, "acquire", 2) == (2, checksum_2)
    assert set(_ask(learner, "delivered", 2, 3)) == {member_a, member_b, member_c}

    # b dies after the first bucket of version 3; the others still get it, the learner goes on.
    _, checksum_3, publish_3_s = _ask(learner, "publish", 3)
    assert _ask(a, "acquire", 3) == (3, checksum_3)
    assert _ask(c, "acquire", 3) == (3, checksum_3)
    proc_b.join(timeout=10)
    assert proc_b.exitcode == -signal.SIGKILL
    _, checksum_4, publish_4_s = _ask(learner, "publish", 4)
    assert _ask(a, "acquire", 4) == (4, checksum_4)
    assert _ask(c, "acquire", 4) == (4, checksum_4)
    assert _ask(learner, "delivered", 4, 2) == [member_a, member_c]
    assert len({checksum_1, checksum_2, checksum_3, checksum_4}) == 4
    # publish waits at most for a broadcast in flight (one deadline), never for the group to re-form
    assert publish_3_s < 1.0 and publish_4_s < TIMEOUT_S + 1.0, (publish_3_s, publish_4_s)
    for conn in (a, c, learner):
        conn.send(("stop",))
