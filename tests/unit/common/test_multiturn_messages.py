"""Multi-turn episodes on the wire: turns, stop reason, loss mask and per-turn rewards survive the
codec, a plain msgpack reader and a real Redis stream, inside a Trajectory, a ScoredTrajectory and a
TrainingBatch."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np

from streamrl.common.bus import PAYLOAD_FIELD, Bus, connect
from streamrl.common.codec import decode, encode
from streamrl.common.messages import Message, ScoredTrajectory, Tensor, TrainingBatch, Trajectory, Turn
from streamrl.common.streams import StreamNames

TURNS = [
    Turn(start=0, end=3, policy_version=4, reward=0.5),
    Turn(start=5, end=7, policy_version=4, reward=-0.25),
    Turn(start=9, end=12, policy_version=5, reward=0.0),
]


def episode(index: int = 0) -> Trajectory:
    """Three model turns (versions 4, 4, 5: an update landed before the last) with environment tokens
    (loss mask 0, behaviour log-probs 0) after the first two."""
    mask = np.zeros(12, dtype=np.uint8)
    logprobs = np.zeros(12, dtype=np.float32)
    for turn in TURNS:
        mask[turn.start : turn.end] = 1
        logprobs[turn.start : turn.end] = -0.5 - 0.125 * np.arange(turn.end - turn.start)
    return Trajectory(
        id=f"p1/{index}",
        group_id="p1",
        group_index=index,
        group_size=2,
        prompt_ids=Tensor.from_list([1, 2, 3], "int32"),
        response_ids=Tensor.from_numpy(np.arange(10, 22, dtype=np.int32)),
        logprobs=Tensor.from_numpy(logprobs),
        loss_mask=Tensor.from_numpy(mask),
        turns=TURNS,
        stop_reason="done",
        policy_version_start=4,
        policy_version_end=5,
        response_text="a<tool>3</tool>b<tool>4</tool>c",
    )


def scored(index: int = 0) -> ScoredTrajectory:
    return ScoredTrajectory(trajectory=episode(index), reward=1.25, turn_rewards=[0.5, -0.25, 1.0], score=1.0)


def batch() -> TrainingBatch:
    return TrainingBatch(id="batch-0", index=0, samples=[scored(0), scored(1)], policy_version=5, staleness=[1, 1])


def test_codec_round_trip_keeps_every_turn() -> None:
    for message in (episode(), scored(), batch()):
        assert decode(encode(message)) == message
    back = decode(encode(batch()), TrainingBatch).samples[1]
    assert back.trajectory.turns == TURNS and back.trajectory.stop_reason == "done"
    assert back.turn_rewards == [0.5, -0.25, 1.0]
    assert back.trajectory.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1]


def test_plain_msgpack_view_of_the_turns() -> None:
    plain = msgpack.unpackb(encode(scored()), raw=False)
    assert plain["turn_rewards"] == [0.5, -0.25, 1.0]
    assert plain["trajectory"]["turns"][1] == {"start": 5, "end": 7, "policy_version": 4, "reward": -0.25}
    assert plain["trajectory"]["stop_reason"] == "done"


def test_single_turn_messages_carry_no_turn_fields() -> None:
    """A single-turn trajectory decodes with empty turns, as before the multi-turn fields existed."""
    t = episode()
    single = Trajectory(**{f: getattr(t, f) for f in t.__struct_fields__ if f not in ("turns", "stop_reason")})
    decoded = decode(encode(ScoredTrajectory(trajectory=single, reward=1.0)), ScoredTrajectory)
    assert decoded.trajectory.turns == [] and decoded.turn_rewards == [] and decoded.trajectory.stop_reason == ""


def test_round_trip_through_redis_streams(redis_url: str, run_id: str) -> None:
    names = StreamNames(run_id)

    async def main() -> list[Message]:
        client = connect(redis_url)
        try:
            bus = Bus(client)
            sent = [(names.trajectories, episode()), (names.scored, scored()), (names.batches, batch())]
            for stream, message in sent:
                await bus.publish(stream, message)
            out = []
            for stream, _ in sent:
                ((_, fields),) = await client.xrange(stream)
                out.append(decode(fields[PAYLOAD_FIELD]))
            return out
        finally:
            await client.aclose()

    assert asyncio.run(main()) == [episode(), scored(), batch()]
