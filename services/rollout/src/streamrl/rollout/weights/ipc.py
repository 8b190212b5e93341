"""Receive the learner's weights over CUDA IPC, for an engine on the learner's own GPU (colocated mode).

The learner (``streamrl.learner.rl.weights.ipc``) keeps its weights in persistent flat buffers on its
GPU and describes them in ``WeightsPublished.ipc`` (:class:`IpcWeights`: CUDA IPC handles, tensor
layout) with a checksum. :class:`IpcWeightReceiver` on the engine's side:

1. checks that the engine's GPU is the learner's (same device UUID) and that the layout fits the
   buffers (:func:`streamrl.rollout.weights.ipc_plan.plan_ipc`);
2. opens each buffer's handle once (``UntypedStorage._new_shared_cuda``) and keeps it open: the
   learner reuses its buffers for every version;
3. copies the learner's buffers into its own staging buffers on the device, so the learner may
   overwrite its buffers right after, and recomputes the checksum on the staged copy: a mismatch
   (a copy that raced the learner's next publish, a corrupted buffer) raises
   :class:`WeightSyncError` and nothing is returned;
4. returns ``(name, tensor)`` views of the staging buffers; the engine copies them into its
   parameters before the next fetch.

The checksum and the typed views are :mod:`streamrl.torchkit.flat`'s, the code the learner packs
and hashes its buffers with (``tests/unit/torchkit/test_flat.py`` checks the documented definition).

Memory: the staging buffers are a second copy of the weights on the GPU. In containers, CUDA IPC
between the learner and the engine needs a shared IPC namespace and ``/dev/shm`` (torch's
reference counters live there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcBuffer, IpcTensor, IpcWeights
from streamrl.rollout.weights.ipc_plan import checksum_problem, plan_ipc
from streamrl.torchkit.flat import tensor_views, weights_checksum

logger = logging.getLogger(__name__)


class IpcWeightReceiver:
    """Fetches IPC-published weights into staging buffers on ``device``; see the module docstring.

    Example:
        receiver = IpcWeightReceiver(torch.device("cuda", 0))
        for name, tensor in receiver.fetch(msg.ipc, msg.version, msg.checksum):
            params[name].copy_(tensor)  # before the next fetch
    """

    def __init__(self, device: torch.device | str | int) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC weights need a CUDA device, got {device}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.device_uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self._opened: dict[tuple[bytes, int], torch.Tensor] = {}
        """The learner's buffers, by (handle, offset in its allocation): a CUDA allocation may hold several."""
        self._staging: list[torch.Tensor] = []
        self._layout: list[IpcTensor] = []
        self._named_views: list[tuple[str, torch.Tensor]] = []
        """(name, view of staging) for ``_layout``: built once, the layout repeats every version."""

    def fetch(self, ipc: IpcWeights, version: int, checksum: str) -> list[tuple[str, torch.Tensor]]:
        """Copy the learner's buffers, verify ``checksum`` for ``version``, return (name, tensor) views.

        The views live in this receiver's staging buffers and are valid until the next ``fetch``.
        Raises :class:`WeightSyncError` (nothing returned) when the engine is not on the learner's
        GPU, a handle cannot be opened, or the staged bytes do not match the checksum.
        """
        if ipc.device_uuid != self.device_uuid:
            raise WeightSyncError(
                f"the engine is not on the learner's GPU (learner: {ipc.device_uuid}, engine: {self.device} = "
                f"{self.device_uuid}): CUDA IPC weights need both on one device; use learner.weights_transport = 'zmq'"
            )
        plan_ipc(ipc)  # a layout that does not fit its buffers is refused before a handle is opened
        sources = [self._open(b) for b in ipc.buffers]
        keep = {(b.handle, b.storage_offset_bytes) for b in ipc.buffers}
        self._opened = {k: v for k, v in self._opened.items() if k in keep}  # buffers the learner replaced
        if [s.numel() for s in self._staging] != [s.numel() for s in sources]:
            self._staging = [torch.empty_like(s) for s in sources]
            self._layout = []
        if self._layout != ipc.tensors:
            views = tensor_views(self._staging, ipc.tensors)
            self._named_views = [(t.name, view) for t, view in zip(ipc.tensors, views, strict=True)]
            self._layout = ipc.tensors
        with torch.cuda.device(self.device):
            for staging, source in zip(self._staging, sources, strict=True):
                staging.copy_(source)  # one device-to-device memcpy per buffer (a foreach copy of bytes is slower)
            staged = weights_checksum(self._staging, version, ipc.block_bytes)  # waits for the copies
        problem = checksum_problem(version, staged, checksum)
        if problem is not None:
            raise WeightSyncError(problem)
        return list(self._named_views)

    def release_staging(self) -> None:
        """Free the staging buffers (the engine sleeps); the next :meth:`fetch` allocates them again.
        The learner's buffers stay open: they are the learner's memory, not a copy."""
        self._staging, self._layout, self._named_views = [], [], []

    @property
    def staging(self) -> list[torch.Tensor]:
        """The staging buffers (flat uint8) holding the last fetched version."""
        return self._staging

    def _open(self, buffer: IpcBuffer) -> torch.Tensor:
        key = (buffer.handle, buffer.storage_offset_bytes)
        opened = self._opened.get(key)
        if opened is None:
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    self.device.index,
                    buffer.handle,
                    buffer.storage_size_bytes,
                    buffer.storage_offset_bytes,
                    buffer.ref_counter_handle,
                    buffer.ref_counter_offset,
                    buffer.event_handle,
                    buffer.event_sync_required,
                )
            except RuntimeError as e:
                raise WeightSyncError(f"could not open the learner's CUDA IPC buffer: {e}") from e
            opened = self._opened[key] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            logger.info("opened a CUDA IPC weight buffer of %d bytes", buffer.storage_size_bytes)
        return opened


class FlatParameters:
    """A model's parameters moved into flat buffers laid out like the learner's IPC buffers, so that
    loading a fetched version is one device-to-device copy per buffer instead of one per tensor.

    Built once per layout: every parameter's data becomes a view of the flat buffers at the offset
    its name has in the layout (its current values copied there first). A parameter that appears
    under two names (tied embeddings) lives at the first; the second name's slot is loaded too and
    left unread. Every parameter must be in the layout with its shape and dtype, and every name in
    the layout must be a parameter or buffer of the model (else :class:`WeightSyncError`). Kernels
    captured before (CUDA graphs) read the old storage: recapture them after building this.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        parameters: list[torch.nn.Parameter],
        ipc: IpcWeights,
        staging: Sequence[torch.Tensor],
    ) -> None:
        unknown = [t.name for t in ipc.tensors if t.name not in tensors]
        if unknown:
            raise WeightSyncError(f"the published weights name tensors the model does not have: {unknown[:5]}")
        self.layout = ipc.tensors
        self.buffers = [torch.empty_like(s) for s in staging]
        homed: set[int] = set()
        with torch.no_grad():
            for t, view in zip(ipc.tensors, tensor_views(self.buffers, ipc.tensors), strict=True):
                target = tensors[t.name]
                if tuple(target.shape) != tuple(view.shape) or target.dtype != view.dtype:
                    raise WeightSyncError(
                        f"{t.name}: published {tuple(view.shape)} {view.dtype}, the model has "
                        f"{tuple(target.shape)} {target.dtype}"
                    )
                view.copy_(target)
                if id(target) not in homed:
                    target.data = view
                    homed.add(id(target))
        missing = [i for i, p in enumerate(parameters) if id(p) not in homed]
        if missing:
            raise WeightSyncError(f"the published weights lack {len(missing)} of the model's parameters")

    def load(self, staging: Sequence[torch.Tensor]) -> None:
        """Copy a verified version from the receiver's staging buffers into the parameters."""
        with torch.no_grad():
            for buffer, source in zip(self.buffers, staging, strict=True):
                buffer.copy_(source)
