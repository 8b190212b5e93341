"""The ``ipc`` transport: CUDA IPC between the learner and engines on its own GPU (colocated mode), both ends.

With ``learner.weights_transport = "ipc"`` the weights never leave the GPU:

1. On the first publish, :class:`IpcPublisher` plans a layout (:func:`streamrl.torchkit.flat.plan_layout`), allocates
   persistent flat buffers on the learner's device (about ``bucket_bytes`` each, one dtype per
   buffer, every tensor starting at a multiple of ``BLOCK_BYTES``) and shares each buffer once
   (``UntypedStorage._share_cuda_()``). It keeps ``num_sets`` such sets (``learner.weights_ipc_buffer_sets``,
   default 2), each allocated and shared at its first use, and writes the versions into them in turn.
2. Every publish takes the next set once no engine is still copying it (:class:`.ipc_sets.BufferSets`:
   a lock file per set that readers hold while they copy; a reader stuck past ``reader_wait_s`` is
   written over, with a warning), copies the parameters into views of its buffers
   (``torch._foreach_copy_``, a bucket at a time so a streamed ZeRO-3 gather holds little extra
   memory), computes the checksum on the device (:func:`streamrl.torchkit.flat.weights_checksum`) and
   waits for the copies; the receiver can read as soon as the ``WeightsPublished`` message (carrying
   :class:`IpcWeights` of that set and the checksum) is out.

Receivers (:class:`IpcReceiver`) check that they are on the learner's GPU (same device UUID) and that
the layout fits the buffers (:func:`.ipc_plan.plan_ipc`), open each handle once, per set
(``UntypedStorage._new_shared_cuda``), and, holding the set's reader lock (:class:`.ipc_sets.SetReader`:
a set that moved on to a newer version is refused before anything is copied), copy the buffers into
their own staging buffers (one device-to-device copy each) and verify the checksum there. The
checksum stays the last line: a reader that was written over (stuck past the learner's wait) sees a
mismatch, never a silent mix. The views they yield live in the staging buffers.

The layout, the typed views and the checksum are :mod:`streamrl.torchkit.flat`'s (the receiver
uses the same code): every tensor on its own block, a digest of block sums computed on the device.

With tied embeddings ``lm_head.weight`` is sent explicitly (as on the ZMQ path).

Memory: each buffer set is a copy of what is published on the learner's GPU, and the staging
buffers another one in each engine. In containers, CUDA IPC
between the learner and the engine needs a shared IPC namespace and ``/dev/shm`` (torch's
reference counters live there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import IpcBuffer, IpcTensor, IpcWeights, WeightsPublished, WeightsTransport
from streamrl.torchkit.flat import BLOCK_BYTES, plan_layout, tensor_views, weights_checksum
from streamrl.torchkit.weights.ipc_plan import checksum_problem, ipc_refusal, plan_ipc
from streamrl.torchkit.weights.ipc_sets import BufferSets, SetReader, check_num_sets
from streamrl.torchkit.weights.protocol import PublishedWeights, Received
from streamrl.torchkit.weights.tied import TIED_ALIASES, tied_copies

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20
DEFAULT_READER_WAIT_S = 10.0
"""How long a publish waits for an engine still copying the set it is about to write (a copy takes
milliseconds; past this the engine is stuck, and the set is written anyway)."""


class _Set:
    """One set of flat buffers: the buffers, the views of the layout's tensors, and its shared description."""

    def __init__(self, buffers: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.views = views
        self.description: IpcWeights | None = None
        """Its handles, shared at its first publish."""


class IpcPublisher:
    """Copies weights into persistent CUDA buffers shared once over CUDA IPC; see the module docstring.

    ``num_sets``: buffer sets to rotate through (1: every version rewrites the same buffers; the
    packer of the broadcast path uses one and never publishes). ``reader_wait_s``: the longest a publish
    waits for an engine still copying the set it is about to write.

    Example:
        publisher = IpcPublisher(bucket_bytes=512 * 2**20, num_sets=2)
        fields = publisher.publish(engine.iter_full_params(), version=3)
        # -> WeightsPublished(version=3, **fields, ...)
    """

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        tied_aliases: Mapping[str, tuple[str, ...]] = TIED_ALIASES,
        num_sets: int = 1,
        reader_wait_s: float = DEFAULT_READER_WAIT_S,
    ) -> None:
        check_num_sets(num_sets)
        if reader_wait_s <= 0:
            raise ValueError(f"reader_wait_s must be > 0, got {reader_wait_s}")
        self._bucket_bytes = bucket_bytes
        self._tied_aliases = tied_aliases
        self._num_sets = num_sets
        self._reader_wait_s = reader_wait_s
        self._layout: list[IpcTensor] = []
        self._sizes: list[int] = []
        """Bytes of each buffer of a set."""
        self._sets: dict[int, _Set] = {}
        self._buffers: list[torch.Tensor] = []
        """The buffers of the set holding the last packed version."""
        self._views: list[torch.Tensor] = []
        self._nbytes: list[int] = []
        self._num_streamed = 0
        """The first ``_num_streamed`` layout entries come from the caller; the rest are tied aliases."""
        self._aliases: list[tuple[int, int]] = []
        """(alias's layout index, its source's layout index) of the tied aliases."""
        self._device: torch.device | None = None
        self._guard: BufferSets | None = None
        """The sets' reader locks, made at the first publish (a bare ``pack`` needs none)."""
        self._version = -1

    @property
    def num_bytes(self) -> int:
        """Bytes of the tensors published (padding excluded)."""
        return sum(self._nbytes)

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    @property
    def num_sets(self) -> int:
        return self._num_sets

    @property
    def forced_writes(self) -> int:
        """Sets written while an engine still held them past ``reader_wait_s`` (each costs it a version)."""
        return 0 if self._guard is None else self._guard.forced_writes

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat uint8 buffers holding the last packed version (empty before the first)."""
        return self._buffers

    @property
    def layout(self) -> list[IpcTensor]:
        """Where each tensor lies in :attr:`buffers`, in publishing order (tied aliases last)."""
        return self._layout

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishedWeights:
        """Copy ``named_tensors`` (all on one CUDA device) in as ``version``, into the next buffer set once no
        engine is copying it; the event's ``ipc`` describes that set (the same for every version it holds)."""
        started = time.perf_counter()
        if self._guard is None:
            named_tensors = list(named_tensors)  # the first version is planned from the whole list anyway
            if named_tensors and named_tensors[0][1].device.type != "cuda":
                raise self._not_on_cuda(named_tensors[0][1].device)
            self._guard = BufferSets(self._num_sets, self._reader_wait_s)
        claimed = time.perf_counter()
        with self._guard.claim(version) as index:
            waited = time.perf_counter() - claimed
            checksum = self.pack(named_tensors, version, buffer_set=index)
            held = self._sets[index]
            if held.description is None:
                held.description = self._share(index)
        logger.info(
            "published weights version %d over CUDA IPC: %d tensors, %d bytes in %d buffers of set %d/%d "
            "(%.1f ms, %.1f of them waiting for readers)",
            version,
            len(self._layout),
            self.num_bytes,
            self.num_buffers,
            index,
            self._num_sets,
            (time.perf_counter() - started) * 1e3,
            waited * 1e3,
        )
        return PublishedWeights(
            transport="ipc",
            checksum=checksum,
            num_bytes=self.num_bytes,
            num_buckets=self.num_buffers,
            endpoint="",
            ipc=held.description,
            broadcast=None,
        )

    def close(self) -> None:
        """Drop the buffers and the reader locks (receivers keep what they opened until they close)."""
        self._sets, self._buffers, self._views = {}, [], []
        if self._guard is not None:
            self._guard.close()
            self._guard = None

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, buffer_set: int = 0) -> str:
        """Copy ``named_tensors`` into buffer set ``buffer_set`` (allocated on their device at its first use)
        and return the checksum of ``version``; works on any device (:meth:`publish` adds the rotation,
        the reader locks and the sharing)."""
        if version <= self._version:
            raise ValueError(f"version must increase: {version} after {self._version}")
        assert 0 <= buffer_set < self._num_sets, f"buffer set {buffer_set} of {self._num_sets}"
        if not self._layout:
            self._plan_and_copy(list(named_tensors), buffer_set)
        else:
            self._select(buffer_set)
            self._copy_streamed(named_tensors)
        for alias, source in self._aliases:
            self._views[alias].copy_(self._views[source])
        checksum = weights_checksum(self._buffers, version)  # its result waits for every copy above
        self._version = version
        return checksum

    def _plan_and_copy(self, named: list[tuple[str, torch.Tensor]], buffer_set: int) -> None:
        """The first version: plan the layout, allocate its set, copy in one go."""
        names = {name: i for i, (name, _) in enumerate(named)}
        self._num_streamed = len(named)
        aliases = [(a, names[s]) for a, s in tied_copies(names, self._tied_aliases)]
        self._layout, self._sizes = plan_layout(named + [(a, named[i][1]) for a, i in aliases], self._bucket_bytes)
        self._aliases = [(len(named) + k, i) for k, (_, i) in enumerate(aliases)]
        self._device = named[0][1].device
        self._select(buffer_set)
        self._nbytes = [v.numel() * v.element_size() for v in self._views]
        with torch.no_grad():
            torch._foreach_copy_(self._views[: len(named)], [t for _, t in named])

    def _select(self, buffer_set: int) -> None:
        """Make ``buffer_set`` the one packed into (allocated, zeroed, at its first use)."""
        held = self._sets.get(buffer_set)
        if held is None:
            assert self._device is not None
            buffers = [torch.zeros(size, dtype=torch.uint8, device=self._device) for size in self._sizes]
            held = self._sets[buffer_set] = _Set(buffers, tensor_views(buffers, self._layout))
        self._buffers, self._views = held.buffers, held.views

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

    @staticmethod
    def _not_on_cuda(device: torch.device) -> ValueError:
        return ValueError(
            f"learner.weights_transport = 'ipc' needs the weights on a CUDA device, they are on {device}: "
            "set learner.weights_transport = 'zmq'"
        )

    def _share(self, index: int) -> IpcWeights:
        """Share set ``index``'s buffers (once: their handles stay valid while the learner holds them)."""
        assert self._guard is not None
        device = self._sets[index].buffers[0].device
        if device.type != "cuda":
            raise self._not_on_cuda(device)
        buffers = []
        for buffer in self._sets[index].buffers:
            _, handle, size, offset, ref_counter, ref_offset, event, event_sync = (
                buffer.untyped_storage()._share_cuda_()
            )
            buffers.append(IpcBuffer(handle, size, offset, ref_counter, ref_offset, event, event_sync))
        return IpcWeights(
            device_uuid=str(torch.cuda.get_device_properties(device).uuid),
            block_bytes=BLOCK_BYTES,
            buffers=buffers,
            tensors=self._layout,
            buffer_set=index,
            num_sets=self._num_sets,
            reader_lock=self._guard.path(index),
        )


class IpcReceiver:
    """Fetches IPC-published weights into staging buffers on ``device``; see the module docstring.
    ``tensor_parallel_size``: of the engine this receiver feeds (CUDA IPC reaches one GPU only).

    Example:
        receiver = IpcReceiver(torch.device("cuda", 0))
        with receiver.receive(event, timeout_s=60) as received:
            load(received.tensors)  # views of the staging buffers
    """

    transport: WeightsTransport = "ipc"

    def __init__(self, device: torch.device | str | int, tensor_parallel_size: int = 1) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        refusal = ipc_refusal(on_cpu=device.type != "cuda", tensor_parallel_size=tensor_parallel_size)
        if refusal is not None:
            raise WeightSyncError(refusal)
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.device_uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self._opened: dict[int, dict[tuple[bytes, int], torch.Tensor]] = {}
        """The learner's buffers by set, then by (handle, offset in its allocation): a CUDA allocation may hold
        several."""
        self._reader = SetReader()
        """Holds a set's reader lock while its copy runs."""
        self._staging: list[torch.Tensor] = []
        self._layout: list[IpcTensor] = []
        self._named_views: list[tuple[str, torch.Tensor]] = []
        """(name, view of staging) for ``_layout``: built once, the layout repeats every version."""

    @contextmanager
    def receive(
        self, event: WeightsPublished, timeout_s: float, abandoned: threading.Event | None = None
    ) -> Iterator[Received]:
        """See :class:`~.protocol.WeightReceiver`; the copy is one device-to-device memcpy per buffer, no deadline."""
        assert event.ipc is not None, "an ipc event names its buffers"
        yield Received(event.version, self.fetch(event.ipc, event.version, event.checksum))

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
        opened = self._opened.setdefault(ipc.buffer_set, {})
        sources = [self._open(b, opened) for b in ipc.buffers]
        keep = {(b.handle, b.storage_offset_bytes) for b in ipc.buffers}
        for key in [k for k in opened if k not in keep]:  # buffers the learner replaced (a new learner)
            del opened[key]
        if [s.numel() for s in self._staging] != [s.numel() for s in sources]:
            self._staging = [torch.empty_like(s) for s in sources]
            self._layout = []
        if self._layout != ipc.tensors:
            views = tensor_views(self._staging, ipc.tensors)
            self._named_views = [(t.name, view) for t, view in zip(ipc.tensors, views, strict=True)]
            self._layout = ipc.tensors
        # the learner does not rewrite the set while we hold its lock; a set that moved on is refused here
        with self._reader.reading(ipc.reader_lock, ipc.buffer_set, version), torch.cuda.device(self.device):
            for staging, source in zip(self._staging, sources, strict=True):
                staging.copy_(source)  # one device-to-device memcpy per buffer (a foreach copy of bytes is slower)
            staged = weights_checksum(self._staging, version, ipc.block_bytes)  # waits for the copies
        problem = checksum_problem(version, staged, checksum)
        if problem is not None:
            raise WeightSyncError(problem)
        return list(self._named_views)

    def release_memory(self) -> None:
        """Free the staging buffers (the engine sleeps); the next :meth:`fetch` allocates them again.
        The learner's buffers stay open: they are the learner's memory, not a copy."""
        self._staging, self._layout, self._named_views = [], [], []
        torch.cuda.empty_cache()

    def close(self) -> None:
        self.release_memory()
        self._opened = {}
        self._reader.close()

    @property
    def staging(self) -> list[torch.Tensor]:
        """The staging buffers (flat uint8) holding the last fetched version."""
        return self._staging

    def _open(self, buffer: IpcBuffer, cache: dict[tuple[bytes, int], torch.Tensor]) -> torch.Tensor:
        key = (buffer.handle, buffer.storage_offset_bytes)
        opened = cache.get(key)
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
            opened = cache[key] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            logger.info("opened a CUDA IPC weight buffer of %d bytes", buffer.storage_size_bytes)
        return opened
