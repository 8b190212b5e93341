"""A three-turn episode as a Trajectory, a ScoredTrajectory and a TrainingBatch (shared by the unit and integration
multi-turn message tests)."""

from __future__ import annotations

import numpy as np

from streamrl.common.messages import ScoredTrajectory, Tensor, TrainingBatch, Trajectory, Turn

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
