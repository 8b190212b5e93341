"""CUDA IPC weights into an engine: the parts that need no GPU (and no torch).

* :func:`plan_ipc` - the learner's :class:`IpcWeights` message (its buffer set and reader lock
  named) checked and turned into one :class:`PlannedTensor` per name (where its bytes lie, how
  many), before any handle is opened: a
  layout that does not fit its buffers is refused with a :class:`WeightSyncError` naming the tensor.
  The names are the learner's Hugging Face checkpoint names; the transformers engine copies them
  into its parameters by name, vLLM's ``load_weights`` maps them itself (stacked q/k/v and
  gate/up projections; a tied ``lm_head.weight`` is skipped by models that tie it).
* :func:`checksum_problem` - the comparison of the staged copy's device checksum
  (:func:`streamrl.torchkit.flat.weights_checksum`) with the one the signed event names.
* :func:`ipc_refusal` - when an engine cannot take IPC weights at all, and why (the receiver then
  refuses every update with that reason).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcWeights

DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""Bytes per element of the dtypes a weight layout may name (torch's names)."""


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One tensor of a version: where its bytes lie in the flat buffers."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer: int
    offset_bytes: int
    num_bytes: int


def plan_ipc(ipc: IpcWeights) -> list[PlannedTensor]:
    """The tensors of ``ipc`` in publishing order, each checked against its buffer (see the module docstring)."""
    _check_header(ipc)
    block = ipc.block_bytes
    sizes = [b.storage_size_bytes for b in ipc.buffers]
    seen: set[str] = set()
    plan = []
    for t in ipc.tensors:
        if t.name in seen:
            raise WeightSyncError(f"IPC weights: the layout names {t.name!r} twice")
        seen.add(t.name)
        itemsize = DTYPE_BYTES.get(t.dtype)
        if itemsize is None:
            raise WeightSyncError(f"IPC weights: {t.name}: unknown dtype {t.dtype!r}")
        if any(d < 0 for d in t.shape):
            raise WeightSyncError(f"IPC weights: {t.name}: negative dimension in {t.shape}")
        if not 0 <= t.buffer < len(sizes):
            raise WeightSyncError(f"IPC weights: {t.name}: buffer {t.buffer} of a message with {len(sizes)} buffers")
        if t.offset_bytes < 0 or t.offset_bytes % block:
            raise WeightSyncError(f"IPC weights: {t.name}: offset {t.offset_bytes} is not a multiple of {block}")
        numel = 1
        for d in t.shape:
            numel *= d
        end = t.offset_bytes + numel * itemsize
        if end > sizes[t.buffer]:
            raise WeightSyncError(
                f"IPC weights: {t.name}: bytes {t.offset_bytes}..{end} lie outside buffer {t.buffer} of "
                f"{sizes[t.buffer]} bytes"
            )
        plan.append(PlannedTensor(t.name, t.dtype, tuple(t.shape), t.buffer, t.offset_bytes, numel * itemsize))
    return plan


def _check_header(ipc: IpcWeights) -> None:
    """What the message says beside its tensors: the block size, its buffer set and the set's reader lock."""
    if ipc.block_bytes <= 0 or ipc.block_bytes % 4:
        raise WeightSyncError(f"IPC weights: block_bytes {ipc.block_bytes} is not a positive multiple of 4")
    if not ipc.tensors:
        raise WeightSyncError("IPC weights: the message names no tensors")
    if not 0 <= ipc.buffer_set < ipc.num_sets:
        raise WeightSyncError(f"IPC weights: buffer set {ipc.buffer_set} of a learner with {ipc.num_sets} sets")
    if not ipc.reader_lock:
        raise WeightSyncError("IPC weights: the message names no reader lock (a learner older than this engine?)")


def checksum_problem(version: int, staged: str, published: str) -> str | None:
    """None when the staged copy hashes to the published checksum, else what went wrong."""
    if staged == published:
        return None
    return (
        f"checksum mismatch for version {version}: staged {staged}, published {published} (the learner's "
        "buffers changed during the copy, or were corrupted); nothing applied"
    )


def ipc_refusal(*, on_cpu: bool, tensor_parallel_size: int) -> str | None:
    """Why an engine cannot take CUDA IPC weights at all; None when it can try (the receiver still
    checks that it shares the learner's GPU)."""
    zmq = "set learner.weights_transport = 'zmq'"
    if on_cpu:
        return (
            "CUDA IPC weights need a CUDA device; this engine runs on the CPU (vLLM's CPU build, or the "
            f"transformers engine on the CPU) and has no CUDA to open the learner's buffers with: {zmq}"
        )
    if tensor_parallel_size > 1:
        return (
            f"CUDA IPC weights reach one GPU, the learner's; a vLLM engine with tensor_parallel_size="
            f"{tensor_parallel_size} spans several: set learner.weights_transport = 'broadcast' (each worker "
            f"joins the learner's weight group) or 'zmq'"
        )
    return None
