"""What the learner and its rollout workers say over the weight-broadcast rendezvous (torch-free).

With ``learner.weights_transport = "broadcast"``, learner rank 0 (the *publisher*) hosts a
``torch.distributed.TCPStore`` and advertises it in ``WeightsPublished.broadcast``
(:class:`streamrl.common.messages.WeightsBroadcast`). Every receiver (a transformers engine, or each
tensor-parallel worker of a vLLM engine) is a *member*: it registers in the store, and the
publisher builds a process group of itself (rank 0) and the members (ranks 1..n) - never the
default group - on a ``PrefixStore`` of its *generation*. Membership changes (a late joiner, a
member that died or missed a deadline) make a new generation; training never waits for it.

Store keys (all values msgpack of the structs below, except the counters)::

    joins                          counter: registrations so far (``store.add``)
    join/{n}                       member id of registration n (1-based)
    leaves                         counter: members that left on purpose (their engine closed)
    leave/{member}                 set by a member as it leaves
    generation                     current generation, decimal ("0": no group yet)
    gen/{g}/members                GroupMembers: ids in rank order (rank = index + 1)
    gen/{g}/ready/{member}         a listed member is about to build group g
    gen/{g}/start                  GroupStart: ok, or who never came (g is then abandoned)
    gen/{g}/pg/...                 the process group's own rendezvous (a PrefixStore)
    gen/{g}/op/{k}                 Op k of generation g: BroadcastOp or RegroupOp
    gen/{g}/op/{k}/ready/{rank}    member ``rank`` holds its staging buffers for op k
    gen/{g}/op/{k}/abort           the publisher gave op k up: stop waiting for its buckets
    gen/{g}/op/{k}/ack/{rank}      Ack of member ``rank`` for op k

Member::

    n = add(joins, 1); set(join/{n}, id)
    loop: read generation G and gen/{G}/members
          listed         -> set gen/{G}/ready/{id}; wait gen/{G}/start; ok -> build the group, serve ops
          not listed and members.joins_seen >= n -> dropped: register again
          else           -> wait for a newer generation
    ops:  k = 0, 1, ...: wait gen/{G}/op/{k}
          BroadcastOp    -> lock staging, set op ready, receive every bucket (giving up on abort or at
                            the deadline), checksum on the device, set ack, k += 1
          RegroupOp      -> leave the group, look for generation >= the new one
    close: set leave/{id}, add(leaves, 1)

Publisher (a background thread; ``publish`` only copies into the buckets)::

    new registrations, or the last op failed -> regroup: set RegroupOp in the old generation, then
        G += 1, set members and generation, wait for every ready key (deadline); missing members are
        named in the log, dropped, and the next generation is tried without them
    a version not yet delivered to generation G -> set BroadcastOp, wait for every op ready key,
        broadcast bucket by bucket, collect acks (one deadline for the op); a failure sets abort and
        makes a new generation, which gets the current version again (as late joiners do); members
        that missed the deadline are not asked to it (alive, they register again)
    while it waits for keys, a moved ``leaves`` counter ends the wait for the members that left

Keys are never reused: a generation or op number only grows for the life of the store.
"""

from __future__ import annotations

import msgspec

from streamrl.common.messages import WeightsBroadcast

JOINS = "joins"
"""Counter of registrations (``store.add(JOINS, 1)`` returns a member's registration number)."""
LEAVES = "leaves"
"""Counter of members that left on purpose; each also sets :func:`leave_key`."""
GENERATION = "generation"
"""Current generation number, decimal; the publisher sets "0" when it starts."""
POLL_S = 0.01
"""How often a member looks for its next op, and a waiter for keys (s)."""


def join_key(n: int) -> str:
    """Member id of registration ``n``."""
    return f"join/{n}"


def leave_key(member: str) -> str:
    """Set by ``member`` as it leaves (its engine closed)."""
    return f"leave/{member}"


def members_key(generation: int) -> str:
    return f"gen/{generation}/members"


def ready_key(generation: int, member: str) -> str:
    return f"gen/{generation}/ready/{member}"


def start_key(generation: int) -> str:
    return f"gen/{generation}/start"


def group_prefix(generation: int) -> str:
    """Prefix of the process group's own rendezvous keys."""
    return f"gen/{generation}/pg/"


def op_key(generation: int, op: int) -> str:
    return f"gen/{generation}/op/{op}"


def op_ready_key(generation: int, op: int, rank: int) -> str:
    return f"gen/{generation}/op/{op}/ready/{rank}"


def abort_key(generation: int, op: int) -> str:
    return f"gen/{generation}/op/{op}/abort"


def ack_key(generation: int, op: int, rank: int) -> str:
    return f"gen/{generation}/op/{op}/ack/{rank}"


class GroupMembers(msgspec.Struct, frozen=True):
    """The members of a generation, in rank order (rank = index + 1; rank 0 is the publisher)."""

    members: list[str]
    joins_seen: int
    """Registrations the publisher had read when it formed the group: a member registered at or
    below this number and not listed was dropped, and registers again."""


class GroupStart(msgspec.Struct, frozen=True):
    """Whether the listed members build the group (all came) or the generation is abandoned."""

    ok: bool
    missing: list[str] = []
    """Members that did not come before the deadline (they are dropped)."""


class BroadcastOp(msgspec.Struct, tag="weights", frozen=True):
    """Receive ``version``: every bucket, then compare the device checksum with ``checksum``."""

    version: int
    checksum: str


class RegroupOp(msgspec.Struct, tag="regroup", frozen=True):
    """This generation is over: look for generation ``generation`` (or a newer one)."""

    generation: int


Op = BroadcastOp | RegroupOp


class Ack(msgspec.Struct, frozen=True):
    """A member's answer to a BroadcastOp: the checksum it computed, or why it failed."""

    checksum: str = ""
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
_op_decoder = msgspec.msgpack.Decoder(Op)
_members_decoder = msgspec.msgpack.Decoder(GroupMembers)
_start_decoder = msgspec.msgpack.Decoder(GroupStart)
_ack_decoder = msgspec.msgpack.Decoder(Ack)
_rendezvous_decoder = msgspec.msgpack.Decoder(WeightsBroadcast)


def encode(record: GroupMembers | GroupStart | BroadcastOp | RegroupOp | Ack | WeightsBroadcast) -> bytes:
    """The store value of a record (or a rendezvous handed to a process, e.g. a vLLM worker)."""
    return _encoder.encode(record)


def decode_rendezvous(data: bytes) -> WeightsBroadcast:
    return _rendezvous_decoder.decode(data)


def decode_op(data: bytes) -> Op:
    return _op_decoder.decode(data)


def decode_members(data: bytes) -> GroupMembers:
    return _members_decoder.decode(data)


def decode_start(data: bytes) -> GroupStart:
    return _start_decoder.decode(data)


def decode_ack(data: bytes) -> Ack:
    return _ack_decoder.decode(data)
