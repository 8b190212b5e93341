"""Publish the learner's weights over CUDA IPC to rollout engines on the same GPU (colocated mode).

With ``learner.weights_transport = "ipc"`` the weights never leave the GPU:

1. On the first publish, :class:`IpcWeightPublisher` plans a layout (:func:`streamrl.torchkit.flat.plan_layout`), allocates
   persistent flat buffers on the learner's device (about ``bucket_bytes`` each, one dtype per
   buffer, every tensor starting at a multiple of ``BLOCK_BYTES``) and shares each buffer once
   (``UntypedStorage._share_cuda_()``).
2. Every publish copies the parameters into views of those buffers (``torch._foreach_copy_``, a
   bucket at a time so a streamed ZeRO-3 gather holds little extra memory), computes the checksum
   on the device (:func:`streamrl.torchkit.flat.weights_checksum`) and waits for the copies; the receiver can read as soon
   as the ``WeightsPublished`` message (carrying :class:`IpcWeights` and the checksum) is out.

Receivers (``streamrl.rollout.weights.ipc``) open each handle once, copy the buffers into their
own staging memory and verify the checksum there, so the learner may overwrite its buffers at the
next step; a receiver that reads while they change sees a checksum mismatch, never a silent mix.

The layout, the typed views and the checksum are :mod:`streamrl.torchkit.flat`'s (the receiver
uses the same code): every tensor on its own block, a digest of block sums computed on the device.

With tied embeddings ``lm_head.weight`` is sent explicitly (as on the ZMQ path).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

import torch

from streamrl.common.messages import IpcBuffer, IpcTensor, IpcWeights
from streamrl.learner.rl.weights.tied import TIED_ALIASES, tied_copies
from streamrl.torchkit.flat import BLOCK_BYTES, plan_layout, tensor_views, weights_checksum

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20


class IpcWeightPublisher:
    """Copies weights into persistent CUDA buffers shared once over CUDA IPC; see the module docstring.

    Example:
        publisher = IpcWeightPublisher(bucket_bytes=512 * 2**20)
        ipc, checksum = publisher.publish(engine.iter_full_params(), version=3)
        # -> WeightsPublished(version=3, checksum=checksum, endpoint="", ipc=ipc, ...)
    """

    def __init__(
        self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, tied_aliases: Mapping[str, tuple[str, ...]] = TIED_ALIASES
    ) -> None:
        self._bucket_bytes = bucket_bytes
        self._tied_aliases = tied_aliases
        self._layout: list[IpcTensor] = []
        self._buffers: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._nbytes: list[int] = []
        self._num_streamed = 0
        """The first ``_num_streamed`` layout entries come from the caller; the rest are tied aliases."""
        self._alias_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._description: IpcWeights | None = None
        self._version = -1

    @property
    def num_bytes(self) -> int:
        """Bytes of the tensors published (padding excluded)."""
        return sum(self._nbytes)

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat uint8 buffers holding the last packed version (empty before the first)."""
        return self._buffers

    @property
    def layout(self) -> list[IpcTensor]:
        """Where each tensor lies in :attr:`buffers`, in publishing order (tied aliases last)."""
        return self._layout

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[IpcWeights, str]:
        """Copy ``named_tensors`` (all on one CUDA device) in as ``version``; returns (description, checksum).

        The description is the same object for every version (the buffers are reused).
        """
        started = time.perf_counter()
        checksum = self.pack(named_tensors, version)
        if self._description is None:
            self._description = self._share()
        logger.info(
            "published weights version %d over CUDA IPC: %d tensors, %d bytes in %d buffers (%.1f ms)",
            version,
            len(self._layout),
            self.num_bytes,
            self.num_buffers,
            (time.perf_counter() - started) * 1e3,
        )
        return self._description, checksum

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> str:
        """Copy ``named_tensors`` into the buffers (allocated on their device at the first call) and
        return the checksum of ``version``; works on any device (:meth:`publish` adds the sharing)."""
        if version <= self._version:
            raise ValueError(f"version must increase: {version} after {self._version}")
        if not self._buffers:
            self._allocate(list(named_tensors))
        else:
            self._copy_streamed(named_tensors)
        for alias, source in self._alias_copies:
            alias.copy_(source)
        checksum = weights_checksum(self._buffers, version)  # its result waits for every copy above
        self._version = version
        return checksum

    def _allocate(self, named: list[tuple[str, torch.Tensor]]) -> None:
        names = {name: i for i, (name, _) in enumerate(named)}
        self._num_streamed = len(named)
        aliases = [(a, names[s]) for a, s in tied_copies(names, self._tied_aliases)]
        self._layout, sizes = plan_layout(named + [(a, named[i][1]) for a, i in aliases], self._bucket_bytes)
        device = named[0][1].device
        self._buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for size in sizes]
        self._views = tensor_views(self._buffers, self._layout)
        self._nbytes = [v.numel() * v.element_size() for v in self._views]
        self._alias_copies = [(self._views[len(named) + k], self._views[i]) for k, (_, i) in enumerate(aliases)]
        with torch.no_grad():
            torch._foreach_copy_(self._views[: len(named)], [t for _, t in named])

    def _copy_streamed(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors as they come, a bucket's worth per ``_foreach_copy_`` (the caller's tensors are freed as we go)."""
        layout, views, nbytes = self._layout, self._views, self._nbytes
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        pending = 0
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if count >= self._num_streamed:
                    raise ValueError(f"weights layout changed: unexpected extra tensor {name!r}")
                view = views[count]
                if name != layout[count].name or tensor.shape != view.shape or tensor.dtype != view.dtype:
                    raise ValueError(
                        f"weights layout changed: got {name!r} {tuple(tensor.shape)} {tensor.dtype} where "
                        f"{layout[count].name!r} {tuple(view.shape)} {view.dtype} was published"
                    )
                dst.append(view)
                src.append(tensor)
                pending += nbytes[count]
                count += 1
                if pending >= self._bucket_bytes:
                    torch._foreach_copy_(dst, src)
                    dst, src, pending = [], [], 0
            if dst:
                torch._foreach_copy_(dst, src)
        if count != self._num_streamed:
            raise ValueError(f"weights layout changed: {count} tensors where {self._num_streamed} were published")

    def _share(self) -> IpcWeights:
        device = self._buffers[0].device
        if device.type != "cuda":
            raise ValueError(
                f"learner.weights_transport = 'ipc' needs the weights on a CUDA device, they are on {device}: "
                "set learner.weights_transport = 'zmq'"
            )
        buffers = []
        for buffer in self._buffers:
            _, handle, size, offset, ref_counter, ref_offset, event, event_sync = (
                buffer.untyped_storage()._share_cuda_()
            )
            buffers.append(IpcBuffer(handle, size, offset, ref_counter, ref_offset, event, event_sync))
        return IpcWeights(
            device_uuid=str(torch.cuda.get_device_properties(device).uuid),
            block_bytes=BLOCK_BYTES,
            buffers=buffers,
            tensors=self._layout,
        )
