"""CUDA IPC weights into an engine, the parts without a GPU (streamrl.torchkit.weights.ipc_plan): the
IpcWeights message checked and turned into a per-tensor plan before any handle is opened, the
checksum comparison, and when an engine refuses IPC weights (and why)."""

from __future__ import annotations

import msgspec
import pytest

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcBuffer, IpcTensor, IpcWeights
from streamrl.torchkit.weights.ipc_plan import (
    PlannedTensor,
    checksum_problem,
    ipc_refusal,
    plan_ipc,
)

BLOCK = 4096


def _buffer(size: int) -> IpcBuffer:
    return IpcBuffer(b"h", size, 0, b"r", 0, b"e", False)


def _ipc(tensors: list[IpcTensor], sizes: list[int], block: int = BLOCK) -> IpcWeights:
    return IpcWeights(
        device_uuid="GPU-1",
        block_bytes=block,
        buffers=[_buffer(s) for s in sizes],
        tensors=tensors,
        reader_lock="/dev/shm/streamrl-ipc-set0.lock",
    )


def test_a_layout_becomes_one_planned_tensor_per_name_in_publishing_order() -> None:
    tensors = [
        IpcTensor("model.embed_tokens.weight", "bfloat16", [64, 32], 0, 0),
        IpcTensor("model.norm.weight", "bfloat16", [32], 0, BLOCK),
        IpcTensor("lm_head.weight", "float32", [64, 32], 1, 0),
    ]
    plan = plan_ipc(_ipc(tensors, [2 * BLOCK, 2 * BLOCK]))
    assert plan == [
        PlannedTensor("model.embed_tokens.weight", "bfloat16", (64, 32), 0, 0, 64 * 32 * 2),
        PlannedTensor("model.norm.weight", "bfloat16", (32,), 0, BLOCK, 64),
        PlannedTensor("lm_head.weight", "float32", (64, 32), 1, 0, 64 * 32 * 4),
    ]
    assert sum(t.num_bytes for t in plan) == 64 * 32 * 2 + 64 + 64 * 32 * 4


@pytest.mark.parametrize(
    ("tensor", "sizes", "problem"),
    [
        (IpcTensor("w", "bfloat16", [4], 1, 0), [BLOCK], r"w: buffer 1 .* 1 buffers"),
        (IpcTensor("w", "bfloat16", [4096], 0, 0), [BLOCK], r"w: bytes 0\.\.8192 .* buffer 0 of 4096 bytes"),
        (IpcTensor("w", "bfloat16", [4], 0, 100), [2 * BLOCK], r"w: offset 100 is not a multiple of 4096"),
        (IpcTensor("w", "complex32x", [4], 0, 0), [BLOCK], r"w: unknown dtype 'complex32x'"),
        (IpcTensor("w", "float32", [-1, 4], 0, 0), [BLOCK], r"w: negative dimension in \[-1, 4\]"),
    ],
)
def test_a_layout_that_does_not_fit_its_buffers_is_refused_before_a_handle_is_opened(
    tensor: IpcTensor, sizes: list[int], problem: str
) -> None:
    with pytest.raises(WeightSyncError, match=problem):
        plan_ipc(_ipc([tensor], sizes))


def test_a_message_without_tensors_or_with_a_name_twice_is_refused() -> None:
    with pytest.raises(WeightSyncError, match="names no tensors"):
        plan_ipc(_ipc([], [BLOCK]))
    twice = [IpcTensor("w", "float32", [4], 0, 0), IpcTensor("w", "float32", [4], 0, BLOCK)]
    with pytest.raises(WeightSyncError, match=r"names 'w' twice"):
        plan_ipc(_ipc(twice, [2 * BLOCK]))
    with pytest.raises(WeightSyncError, match="block_bytes 102 is not a positive multiple of 4"):
        plan_ipc(_ipc([IpcTensor("w", "float32", [4], 0, 0)], [BLOCK], block=102))


def test_checksum_comparison_names_both_digests_and_the_version() -> None:
    assert checksum_problem(3, "v3:a:b", "v3:a:b") is None
    problem = checksum_problem(3, "v3:a:c", "v3:a:b")
    assert problem is not None and "version 3" in problem and "v3:a:c" in problem and "v3:a:b" in problem
    assert "nothing applied" in problem


def test_ipc_refusal_rules() -> None:
    assert ipc_refusal(on_cpu=False, tensor_parallel_size=1) is None
    cpu = ipc_refusal(on_cpu=True, tensor_parallel_size=1)
    assert cpu is not None and "CPU" in cpu and "no CUDA" in cpu and "weights_transport = 'zmq'" in cpu
    tp = ipc_refusal(on_cpu=False, tensor_parallel_size=2)
    assert tp is not None and "tensor_parallel_size=2" in tp and "broadcast" in tp


def test_a_buffer_set_outside_the_learner_s_sets_and_a_missing_reader_lock_are_refused() -> None:
    tensors = [IpcTensor("model.norm.weight", "bfloat16", [32], 0, 0)]
    ipc = _ipc(tensors, [BLOCK])
    with pytest.raises(WeightSyncError, match=r"buffer set 2 of a learner with 2 sets"):
        plan_ipc(msgspec.structs.replace(ipc, buffer_set=2, num_sets=2))
    with pytest.raises(WeightSyncError, match=r"names no reader lock"):
        plan_ipc(msgspec.structs.replace(ipc, reader_lock=""))
    assert len(plan_ipc(msgspec.structs.replace(ipc, buffer_set=1, num_sets=2))) == 1
