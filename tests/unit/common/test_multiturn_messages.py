"""Multi-turn episodes on the wire: turns, stop reason, loss mask and per-turn rewards survive the
codec and a plain msgpack reader, inside a Trajectory, a ScoredTrajectory and a
TrainingBatch."""

from __future__ import annotations

import msgpack
from multiturn_samples import TURNS, batch, episode, scored

from streamrl.common.codec import decode, encode
from streamrl.common.messages import ScoredTrajectory, TrainingBatch, Trajectory


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
