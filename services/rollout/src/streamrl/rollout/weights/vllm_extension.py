"""vLLM worker extension that receives new weights (over ZMQ, CUDA IPC or the learner's broadcast group) and loads them.

vLLM mixes this class into every worker (``worker_extension_cls``). The rollout engine calls its
methods by name through ``collective_rpc``, so no Python function is shipped to the workers: each
worker pulls the buckets of the version itself (:func:`streamrl.rollout.weights.zmq.torch_tensors`,
which verifies the checksum), and once every worker holds the whole version the engine asks them
to feed it to the model runner's ``reload_weights``. That entry point is what works
on the CPU backend, which repacks linear weights (calling the model's ``load_weights`` directly
changes nothing there) - unless the engine was built with ``cpu_weight_packing`` off: then the
kernels read the live parameters and ``load_weights`` copies the new values into them in place.

Over CUDA IPC (``learner.weights_transport = "ipc"``, the engine on the learner's GPU) the stage call
runs :class:`streamrl.rollout.weights.ipc.IpcWeightReceiver` in the worker process: it opens the
learner's buffers once (the handles arrive as the msgpack bytes of the event's ``IpcWeights``),
copies them into staging buffers on the worker's GPU and verifies the device checksum there
(:func:`streamrl.torchkit.flat.weights_checksum`); the staged views are then loaded like any other
version. The staging buffers stay allocated (a second copy of the weights) so the next version
opens nothing and allocates nothing.

Over the learner's weight-broadcast group (``learner.weights_transport = "broadcast"``) every worker
- each tensor-parallel rank - is a member of its own
(:class:`streamrl.rollout.weights.broadcast.BroadcastReceiver`, built at the first such update):
it receives every version into staging buffers on its device in the background, and the stage
call only waits for the version asked for, checks it against the signed event's checksum and pins
it; vLLM's loader then takes from the full tensors the shard its rank needs.

Imported by vLLM inside the worker by qualified name; it imports torch, never vLLM.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from streamrl.common.errors import WeightSyncError
from streamrl.common.weights.broadcast import decode_rendezvous
from streamrl.rollout.weights.ipc_plan import decode_ipc
from streamrl.rollout.weights.zmq import torch_tensors

logger = logging.getLogger(__name__)


def _reads_weight(cpu_linear: Any) -> bool:
    """Whether a layer's CPU matmul (vLLM's ``cpu_linear``; None off CPU) is torch's F.linear on the
    weight it is handed, rather than a kernel on a repacked copy (oneDNN, SGL, zentorch)."""
    if cpu_linear is None or cpu_linear is torch.nn.functional.linear:
        return True
    code = getattr(cpu_linear, "__code__", None)
    return code is not None and code.co_names[-2:] == ("functional", "linear")


class WeightReceiver:
    """Mixed into the vLLM worker: ``self`` is the worker, ``self.model_runner`` its runner.

    Two phases, so that every worker (tensor-parallel ranks) holds the complete verified version
    before any of them touches its model: ``reload_weights`` empties the layers before it consumes
    the iterator, so an error while receiving inside it would leave a broken model.
    """

    model_runner: Any
    device: torch.device
    rank: int
    _streamrl_staged: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
    _streamrl_member: Any = None
    """BroadcastReceiver of this worker (the learner's weight group), once one is advertised."""
    _streamrl_ipc: Any = None
    """IpcWeightReceiver of this worker (the learner's CUDA IPC buffers, opened once), from the first IPC update."""
    _streamrl_pinned = False
    """The staged version is the member's pinned staging buffers (released once loaded or discarded)."""

    def streamrl_fetch_weights(self, endpoint: str, version: int, checksum: str | None, timeout_s: float) -> str | None:
        """Receive and verify ``version``; keep it staged. Return None, or why it failed."""
        self._streamrl_staged = None
        try:
            weights = list(torch_tensors(endpoint, version, checksum, timeout_s))
        except WeightSyncError as e:
            return str(e)
        self._streamrl_staged = (version, weights)
        return None

    def streamrl_stage_ipc(self, ipc: bytes, version: int, checksum: str) -> str | None:
        """Copy ``version`` from the learner's CUDA IPC buffers (``ipc``: the msgpack bytes of its
        IpcWeights) into this worker's staging buffers and verify ``checksum`` there; keep it staged.
        Return None, or why it failed (nothing staged: not the learner's GPU, a handle that does not
        open, a layout that does not fit, a checksum mismatch)."""
        from streamrl.rollout.weights.ipc import IpcWeightReceiver

        self.streamrl_discard_weights()
        try:
            message = decode_ipc(ipc)
            if self._streamrl_ipc is None:
                self._streamrl_ipc = IpcWeightReceiver(self.device)
            weights = self._streamrl_ipc.fetch(message, version, checksum)
        except (WeightSyncError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        self._streamrl_staged = (version, weights)
        return None

    def streamrl_release_staging(self) -> None:
        """Free the IPC staging buffers (the engine is going to sleep: the memory is the learner's meanwhile)."""
        self.streamrl_discard_weights()
        if self._streamrl_ipc is not None:
            self._streamrl_ipc.release_staging()
            torch.cuda.empty_cache()

    def streamrl_stage_broadcast(
        self, broadcast: bytes, version: int, checksum: str, timeout_s: float
    ) -> tuple[int, str | None]:
        """Wait until this worker's member of the learner's weight group (``broadcast``: a msgpack
        WeightsBroadcast) has received ``version`` hashing to ``checksum`` (the signed event's), and
        stage it (pinned). Return (``version``, None), or (-1, why it failed or was refused)."""
        from streamrl.rollout.weights.broadcast import member_for

        self.streamrl_discard_weights()
        info = decode_rendezvous(broadcast)
        try:
            self._streamrl_member = member_for(self._streamrl_member, info, self.device, f"tp{self.rank}", timeout_s)
            staged, weights = self._streamrl_member.acquire(version, timeout_s, checksum=checksum)
        except WeightSyncError as e:
            return -1, str(e)
        self._streamrl_staged, self._streamrl_pinned = (staged, weights), True
        return staged, None

    def streamrl_close_broadcast(self) -> None:
        """Leave the learner's weight group (the engine is closing)."""
        self.streamrl_discard_weights()
        if self._streamrl_member is not None:
            self._streamrl_member.close()
            self._streamrl_member = None

    def streamrl_apply_weights(self, version: int, in_place: bool = False) -> int:
        """Load the staged ``version`` into the model; return the number of tensors loaded.

        ``in_place``: the kernels read the model's parameters directly (no repacked copies), so the
        model's own ``load_weights`` copies the new values into them; every parameter must be
        written. Otherwise vLLM's ``reload_weights`` reloads and reprocesses layer by layer.
        """
        staged = self._streamrl_staged
        assert staged is not None and staged[0] == version, f"version {version} is not staged"
        start = time.perf_counter()
        try:
            if in_place:
                model = self.model_runner.get_model()  # (under a CUDA graph wrapper on a GPU)
                loaded = model.load_weights(iter(staged[1]))
                missing = {name for name, _ in model.named_parameters()} - set(loaded or ())
                if missing:
                    raise RuntimeError(f"version {version} left parameters unwritten: {sorted(missing)[:5]}")
            else:
                self.model_runner.reload_weights(weights_iterator=iter(staged[1]), is_checkpoint_format=True)
        finally:
            self.streamrl_discard_weights()
        logger.info(
            "loaded weights version %d (%d tensors) in %.3f s", version, len(staged[1]), time.perf_counter() - start
        )
        return len(staged[1])

    def streamrl_has_live_weights(self) -> bool:
        """Whether every linear and embedding layer still holds its full weight (no repacked copy
        replaced it, no quantized layer), so that an in-place update reaches the kernels."""
        for module in self.model_runner.get_model().modules():
            method = type(getattr(module, "quant_method", None)).__name__
            if method != "NoneType" and not method.startswith("Unquantized"):
                return False  # a quantized layer: its loaded tensors are processed into others
            if method in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
                weight = getattr(module, "weight", None)
                if weight is None or weight.numel() == 0 or not _reads_weight(getattr(module, "cpu_linear", None)):
                    return False
        return True

    def streamrl_discard_weights(self) -> None:
        """Drop a staged version (loaded, or another worker failed to receive it); unpin the member's buffers."""
        self._streamrl_staged = None
        if self._streamrl_pinned:
            self._streamrl_pinned = False
            self._streamrl_member.release()
