"""The weight-broadcast rendezvous on the bus and in the store: plain msgpack, old messages still decode."""

from __future__ import annotations

import msgpack

from streamrl.common.codec import decode, encode
from streamrl.common.messages import IpcTensor, WeightsBroadcast, WeightsPublished
from streamrl.common.weights import broadcast as wb

RENDEZVOUS = WeightsBroadcast(
    store="learner-0:29600",
    session="9b1f0c2e4d5a6b7c",
    backend="nccl",
    generation=2,
    block_bytes=4096,
    bucket_bytes=[8192, 4096],
    tensors=[
        IpcTensor("model.embed_tokens.weight", "bfloat16", [4, 8], 0, 0),
        IpcTensor("model.norm.weight", "float32", [8], 1, 0),
        IpcTensor("lm_head.weight", "bfloat16", [4, 8], 0, 4096),
    ],
)


def _published(**extra: object) -> WeightsPublished:
    return WeightsPublished(
        version=3, step=3, batch_id="batch-2", checksum="v3:1:2", num_bytes=96, num_buckets=2, endpoint="", **extra
    )  # type: ignore[arg-type]


def test_weights_published_with_a_rendezvous_round_trips_as_plain_msgpack() -> None:
    message = _published(broadcast=RENDEZVOUS)
    data = encode(message)
    assert decode(data, WeightsPublished) == message
    plain = msgpack.unpackb(data)
    assert plain["broadcast"]["store"] == "learner-0:29600" and plain["broadcast"]["bucket_bytes"] == [8192, 4096]
    assert plain["broadcast"]["tensors"][2] == {
        "name": "lm_head.weight",
        "dtype": "bfloat16",
        "shape": [4, 8],
        "buffer": 0,
        "offset_bytes": 4096,
    }


def test_a_message_without_the_field_decodes_with_no_rendezvous() -> None:
    plain = msgpack.unpackb(encode(_published()))
    del plain["broadcast"]  # as written before the field existed
    assert decode(msgpack.packb(plain), WeightsPublished).broadcast is None


def test_store_records_round_trip() -> None:
    members = wb.GroupMembers(["host:1:hf:aa", "host:2:tp0:bb"], joins_seen=5)
    assert wb.decode_members(wb.encode(members)) == members
    start = wb.GroupStart(ok=False, missing=["host:2:tp0:bb"])
    assert wb.decode_start(wb.encode(start)) == start
    for op in (wb.BroadcastOp(version=7, checksum="v7:a:b"), wb.RegroupOp(generation=4)):
        assert wb.decode_op(wb.encode(op)) == op
    ack = wb.Ack(checksum="v7:a:b")
    assert wb.decode_ack(wb.encode(ack)) == ack and ack.error == ""
    assert wb.decode_rendezvous(wb.encode(RENDEZVOUS)) == RENDEZVOUS


def test_keys_of_different_generations_ops_and_members_never_collide() -> None:
    keys = [wb.JOINS, wb.LEAVES, wb.GENERATION, wb.join_key(1), wb.join_key(11), wb.leave_key("h:1:hf:aa")]
    for g in (1, 2, 12):
        keys += [wb.members_key(g), wb.start_key(g), wb.ready_key(g, "h:1:hf:aa"), wb.group_prefix(g)]
        for k in (0, 1, 10):
            keys += [wb.op_key(g, k), wb.abort_key(g, k)]
            keys += [f(g, k, r) for f in (wb.op_ready_key, wb.ack_key) for r in (1, 2)]
    assert len(set(keys)) == len(keys)
    assert not any(k.startswith(wb.group_prefix(1)) for k in keys if k != wb.group_prefix(1))
