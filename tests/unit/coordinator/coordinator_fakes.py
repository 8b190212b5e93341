"""Hand-made inputs for the coordinator's pieces: a config, a prompt source, scored samples."""

from __future__ import annotations

from typing import Any

from streamrl.common.codec import encode
from streamrl.common.messages import ScoredRecord, Tensor, Trajectory
from streamrl.common.payloads import record_of
from streamrl.coordinator.config import CoordinatorConfig, DatasetConfig
from streamrl.coordinator.prompts import Prompt
from streamrl.coordinator.state import RunState


def config(**fields: Any) -> CoordinatorConfig:
    """A coordinator config for tests that never read its dataset."""
    return CoordinatorConfig(dataset=DatasetConfig(path="unused.jsonl", tokenizer="unused"), **fields)


class Prompts:
    """A stand-in for :class:`PromptSource`: prompt ``i`` is ``"{i}+1="``."""

    def __len__(self) -> int:
        return 1000

    def get(self, cursor: int) -> Prompt:
        return self.encode(cursor % len(self))

    def encode(self, index: int) -> Prompt:
        return Prompt(index=index, text=f"{index}+1=", ids=[1, 2, 3], label=str(index + 1), metadata={})

    def warm(self, indices: range) -> None:
        pass


def sample(
    group: str,
    index: int,
    score: float = 1.0,
    *,
    version: int = 0,
    is_eval: bool = False,
    eval_version: int = 0,
    **scored: Any,
) -> ScoredRecord:
    """A scored record of a 2-token response (payload key: that of run ``r``, attempt ``t``; :func:`store`
    names it under the run it stores to)."""
    traj = trajectory(group, index, version=version, is_eval=is_eval, eval_version=eval_version)
    return ScoredRecord(
        trajectory=record_of(traj, f"streamrl:{{r}}:payload:{traj.id}:t", len(encode(traj))),
        reward=score,
        score=score,
        **scored,
    )


def trajectory(group: str, index: int, *, version: int = 0, is_eval: bool = False, eval_version: int = 0) -> Trajectory:
    """The payload of :func:`sample`'s record."""
    return Trajectory(
        id=f"{group}/{index}",
        group_id=group,
        group_index=index,
        group_size=2,
        prompt_ids=Tensor.from_list([1], "int32"),
        response_ids=Tensor.from_list([5, 6], "int32"),
        logprobs=Tensor.from_list([-1.0, -1.0], "float32"),
        loss_mask=Tensor.from_list([1, 1], "uint8"),
        policy_version_start=version,
        policy_version_end=version,
        is_eval=is_eval,
        metadata={"eval_version": eval_version} if is_eval else {},
    )


async def store(state: RunState, buffer: str, *samples: ScoredRecord) -> None:
    """Write samples into a buffer as the scored consumer does, and each one's payload as the rollout worker
    does (the record's ``payload_key`` set to the run's key, in place)."""
    for s in samples:
        r = s.trajectory
        payload = trajectory(
            r.group_id,
            r.group_index,
            version=r.policy_version_start,
            is_eval=r.is_eval,
            eval_version=int(r.metadata.get("eval_version", 0)),
        )
        r.payload_key = state.names.payload(r.id, "t")
        await state.redis.set(r.payload_key, encode(payload))
        await state.redis.hset(state.names.group_buffer(buffer), r.id, encode(s))
